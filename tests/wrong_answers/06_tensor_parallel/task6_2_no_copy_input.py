"""The column-parallel layer never puts its input through f: the input gradient is partial."""

TASK = "task6_2"
EXPECT = r"summed over the ranks it would be right.*copy_to_parallel"


class ColumnParallelLinear(nn.Module):
    def __init__(self, linear, group=None, copy_input=True):
        super().__init__()
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        rows = split_size(linear.out_features, world_size, "out_features")
        mine = slice(rank * rows, (rank + 1) * rows)
        self.weight = nn.Parameter(linear.weight.detach()[mine].clone())
        self.bias = (nn.Parameter(linear.bias.detach()[mine].clone())
                     if linear.bias is not None else None)
        self.group, self.copy_input = group, copy_input

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)
