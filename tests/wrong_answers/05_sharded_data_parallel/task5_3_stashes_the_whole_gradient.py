"""Sets param.grad to None but keeps the whole gradient on the parameter under another name."""

TASK = "task5_3"
EXPECT = r"hold after backward: .*; the formula for ZeRO-2 on 2 ranks gives"


class Zero2Optimizer:
    def _reduce_scatter_gradient(self, param) -> None:
        shard = self.shard_of[param]
        shard.grad = reduce_scatter_mean(param.grad)[: shard.numel()]
        param.kept_gradient = param.grad
        param.grad = None
