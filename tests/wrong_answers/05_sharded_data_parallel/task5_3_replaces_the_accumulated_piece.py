"""The hook sets the piece's gradient instead of adding to it: with gradient accumulation only the
last micro-batch's gradient survives to the step."""

TASK = "task5_3"
EXPECT = r"accumulated backwards per step.*replaces the piece's \.grad instead of adding to it"


class Zero2Optimizer:
    def _reduce_scatter_gradient(self, param) -> None:
        shard = self.shard_of[param]
        shard.grad = reduce_scatter_mean(param.grad)[: shard.numel()]
        param.grad = None
