"""The row-parallel layer adds its bias to the partial sums: W biases after the all-reduce."""

TASK = "task6_2"
EXPECT = r"bias\(es\) too many.*Add it once, after"


class RowParallelLinear(nn.Module):
    def __init__(self, linear, group=None):
        super().__init__()
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        columns = split_size(linear.in_features, world_size, "in_features")
        mine = slice(rank * columns, (rank + 1) * columns)
        self.weight = nn.Parameter(linear.weight.detach()[:, mine].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None
        self.group = group

    def forward(self, x):
        return reduce_from_parallel(F.linear(x, self.weight, self.bias), self.group)
