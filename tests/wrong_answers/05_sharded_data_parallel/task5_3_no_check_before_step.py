"""Steps whatever pieces have gradients: a step before backward silently does nothing."""

TASK = "task5_3"
EXPECT = r"step\(\) before any backward\(\) returned"


class Zero2Optimizer:
    def step(self) -> None:
        self.optimizer.step()
        for param, shard in zip(self.params, self.shards, strict=True):
            shard.grad = None
            size = shard_size(param.numel(), self.world_size)
            piece = torch.nn.functional.pad(shard, (0, size - shard.numel()))
            whole = torch.empty(self.world_size * size, dtype=param.dtype, device=param.device)
            all_gather_single(whole, piece)
            with torch.no_grad():
                param.view(-1).copy_(whole[: param.numel()])
