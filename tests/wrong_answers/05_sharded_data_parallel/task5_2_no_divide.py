"""Reduce-scatters the gradients but never divides by the world size: a sum, not DDP's mean."""

TASK = "task5_2"
EXPECT = r"update of .* 2x the expected one.*without dividing"


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
            shard.grad = mine[: shard.numel()]
        self.optimizer.step()
        for param, shard in zip(self.params, self.shards, strict=True):
            shard.grad = None
            size = shard_size(param.numel(), self.world_size)
            piece = torch.nn.functional.pad(shard, (0, size - shard.numel()))
            whole = torch.empty(self.world_size * size, dtype=param.dtype, device=param.device)
            all_gather_single(whole, piece)
            with torch.no_grad():
                param.view(-1).copy_(whole[: param.numel()])
