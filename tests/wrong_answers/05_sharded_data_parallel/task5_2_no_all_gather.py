"""Steps this rank's pieces but never all-gathers them: the rest of each parameter goes stale."""

TASK = "task5_2"
EXPECT = r"were not all-gathered back"


class Zero1Optimizer:
    def step(self) -> None:
        for param in self.params:
            if param.grad is None:
                raise RuntimeError("step() before backward()")
        for param, shard in zip(self.params, self.shards, strict=True):
            shard.grad = reduce_scatter_mean(param.grad)[: shard.numel()]
            param.grad = None
        self.optimizer.step()
        for shard in self.shards:
            shard.grad = None
