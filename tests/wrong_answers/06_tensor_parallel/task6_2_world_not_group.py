"""Slices by the whole world's rank and size, not by the group's."""

TASK = "task6_2"
EXPECT = r"Use dist.get_world_size\(group\) and dist.get_rank\(group\)"


class ColumnParallelLinear(nn.Module):
    def __init__(self, linear, group=None, copy_input=True):
        super().__init__()
        rank, world_size = dist.get_rank(), dist.get_world_size()
        rows = split_size(linear.out_features, world_size, "out_features")
        mine = slice(rank * rows, (rank + 1) * rows)
        self.weight = nn.Parameter(linear.weight.detach()[mine].clone())
        self.bias = (nn.Parameter(linear.bias.detach()[mine].clone())
                     if linear.bias is not None else None)
        self.group, self.copy_input = group, copy_input
