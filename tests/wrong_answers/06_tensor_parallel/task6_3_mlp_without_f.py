"""The MLP's up_proj is built with copy_input=False, as the attention's projections are: f is
missing from the MLP, and its input gets only this rank's features' part of the gradient."""

TASK = "task6_3"
EXPECT = r"TensorParallelMLP: the gradient of its input.*1/\d.*copy_to_parallel \(f\) .* is missing"


class TensorParallelMLP(MLP):
    def __init__(self, mlp, group=None):
        nn.Module.__init__(self)
        self.up_proj = ColumnParallelLinear(mlp.up_proj, group, copy_input=False)
        self.down_proj = RowParallelLinear(mlp.down_proj, group)
        self.drop = mlp.drop
