"""Reduce-scatters each gradient in its hook but leaves the whole gradient on the parameter."""

TASK = "task5_3"
EXPECT = r"whole gradients at once during backward.*param\.grad = None"


class Zero2Optimizer:
    def _reduce_scatter_gradient(self, param) -> None:
        shard = self.shard_of[param]
        size = shard_size(param.numel(), self.world_size)
        flat = param.grad.reshape(-1)
        padded = torch.nn.functional.pad(flat, (0, self.world_size * size - flat.numel()))
        mine = torch.empty(size, dtype=flat.dtype, device=flat.device)
        reduce_scatter_single(mine, padded)
        shard.grad = mine[: shard.numel()] / self.world_size
