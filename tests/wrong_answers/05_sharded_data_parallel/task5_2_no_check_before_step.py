"""Steps without checking for gradients: a step before backward crashes deep inside torch."""

TASK = "task5_2"
EXPECT = r"step\(\) before any backward\(\) returned"


class Zero1Optimizer:
    def step(self) -> None:
        for param, shard in zip(self.params, self.shards, strict=True):
            if param.grad is None:
                continue
            size = shard_size(param.numel(), self.world_size)
            flat = param.grad.reshape(-1)
            padded = torch.nn.functional.pad(flat, (0, self.world_size * size - flat.numel()))
            mine = torch.empty(size, dtype=flat.dtype, device=flat.device)
            reduce_scatter_single(mine, padded)
            shard.grad = mine[: shard.numel()] / self.world_size
        self.optimizer.step()
        for param, shard in zip(self.params, self.shards, strict=True):
            shard.grad = None
            size = shard_size(param.numel(), self.world_size)
            piece = torch.nn.functional.pad(shard, (0, size - shard.numel()))
            whole = torch.empty(self.world_size * size, dtype=param.dtype, device=param.device)
            all_gather_single(whole, piece)
            with torch.no_grad():
                param.view(-1).copy_(whole[: param.numel()])
