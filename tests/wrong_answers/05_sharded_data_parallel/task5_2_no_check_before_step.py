"""Steps without checking for gradients: a step before backward silently does nothing."""

TASK = "task5_2"
EXPECT = r"step\(\) before any backward\(\) returned"


class Zero1Optimizer:
    def step(self) -> None:
        for param, shard in zip(self.params, self.shards, strict=True):
            if param.grad is not None:
                shard.grad = reduce_scatter_mean(param.grad)[: shard.numel()]
                param.grad = None
        self.optimizer.step()
        for param, shard in zip(self.params, self.shards, strict=True):
            shard.grad = None
            with torch.no_grad():
                param.view(-1).copy_(all_gather_pieces(shard, param.numel()))
