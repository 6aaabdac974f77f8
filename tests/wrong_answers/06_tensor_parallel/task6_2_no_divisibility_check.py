"""Splits with floor division and no check: 6 features on 4 ranks silently drop 2 of them."""

TASK = "task6_2"
EXPECT = r"accepted a size of 6 on 4 ranks"


class ColumnParallelLinear(nn.Module):
    def __init__(self, linear, group=None, copy_input=True):
        super().__init__()
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        rows = linear.out_features // world_size
        mine = slice(rank * rows, (rank + 1) * rows)
        self.weight = nn.Parameter(linear.weight.detach()[mine].clone())
        self.bias = (nn.Parameter(linear.bias.detach()[mine].clone())
                     if linear.bias is not None else None)
        self.group, self.copy_input = group, copy_input

    def forward(self, x):
        if self.copy_input:
            x = copy_to_parallel(x, self.group)
        return F.linear(x, self.weight, self.bias)
