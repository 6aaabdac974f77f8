"""The hook keeps the sum of the gradient pieces, never divided by the world size."""

TASK = "task5_3"
EXPECT = r"update of .* 2x the expected one.*without dividing"


class Zero2Optimizer:
    def _reduce_scatter_gradient(self, param) -> None:
        shard = self.shard_of[param]
        size = shard_size(param.numel(), self.world_size)
        flat = param.grad.reshape(-1)
        padded = torch.nn.functional.pad(flat, (0, self.world_size * size - flat.numel()))
        mine = torch.empty(size, dtype=flat.dtype, device=flat.device)
        reduce_scatter_single(mine, padded)
        shard.grad = mine[: shard.numel()]
        param.grad = None
