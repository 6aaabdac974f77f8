"""All-reduces the whole gradient in the hook and keeps only this rank's part of it."""

TASK = "task5_3"
EXPECT = r"all-reduced .* reduce_scatter_single gives it exactly that"


class Zero2Optimizer:
    def _reduce_scatter_gradient(self, param) -> None:
        shard = self.shard_of[param]
        dist.all_reduce(param.grad)
        start, end = shard_bounds(param.numel(), self.world_size, self.rank)
        shard.grad = param.grad.reshape(-1)[start:end] / self.world_size
        param.grad = None
