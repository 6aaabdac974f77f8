"""Keeps views of the whole layer's weight: the slice is right, the whole stays in memory."""

TASK = "task6_2"
EXPECT = r"is a view into a tensor of \d+ bytes.*\.clone\(\)"


class ColumnParallelLinear(nn.Module):
    def __init__(self, linear, group=None, copy_input=True):
        super().__init__()
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        rows = split_size(linear.out_features, world_size, "out_features")
        mine = slice(rank * rows, (rank + 1) * rows)
        self.weight = nn.Parameter(linear.weight.detach()[mine])
        self.bias = nn.Parameter(linear.bias.detach()[mine]) if linear.bias is not None else None
        self.group, self.copy_input = group, copy_input
