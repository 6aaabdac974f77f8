"""Column parallel read as "slice the weight's columns": nn.Linear's weight is (out, in)."""

TASK = "task6_2"
EXPECT = r"ColumnParallelLinear keeps a weight of shape .* half of the rows"


class ColumnParallelLinear(nn.Module):
    def __init__(self, linear, group=None, copy_input=True):
        super().__init__()
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        n = split_size(linear.in_features, world_size, "in_features")
        self.weight = nn.Parameter(linear.weight.detach()[:, rank * n:(rank + 1) * n].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone())
        self.group, self.copy_input = group, copy_input

    def forward(self, x):
        if self.copy_input:
            x = copy_to_parallel(x, self.group)
        return F.linear(x, self.weight, self.bias)
