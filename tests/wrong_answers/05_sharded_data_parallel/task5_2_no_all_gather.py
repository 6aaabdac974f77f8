"""Steps this rank's pieces but never all-gathers them: the rest of each parameter goes stale."""

TASK = "task5_2"
EXPECT = r"were not all-gathered back"


class Zero1Optimizer:
    def step(self) -> None:
        for param in self.params:
            if param.grad is None:
                raise RuntimeError("step() before backward()")
        for param, shard in zip(self.params, self.shards, strict=True):
            size = shard_size(param.numel(), self.world_size)
            flat = param.grad.reshape(-1)
            padded = torch.nn.functional.pad(flat, (0, self.world_size * size - flat.numel()))
            mine = torch.empty(size, dtype=flat.dtype, device=flat.device)
            reduce_scatter_single(mine, padded)
            shard.grad = mine[: shard.numel()] / self.world_size
        self.optimizer.step()
        for shard in self.shards:
            shard.grad = None
