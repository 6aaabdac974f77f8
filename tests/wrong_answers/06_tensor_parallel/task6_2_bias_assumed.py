"""Slices linear.bias without checking that there is one: a layer built with bias=False fails."""

TASK = "task6_2"
EXPECT = r"ColumnParallelLinear\(nn\.Linear\(8, 12, bias=False\)\) raised AttributeError"


class ColumnParallelLinear(nn.Module):
    def __init__(self, linear, group=None, copy_input=True):
        super().__init__()
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        rows = split_size(linear.out_features, world_size, "out_features")
        mine = slice(rank * rows, (rank + 1) * rows)
        self.weight = nn.Parameter(linear.weight.detach()[mine].clone())
        self.bias = nn.Parameter(linear.bias.detach()[mine].clone())
        self.group, self.copy_input = group, copy_input
