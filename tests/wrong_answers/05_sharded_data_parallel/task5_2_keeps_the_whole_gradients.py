"""ZeRO-1's step reduce-scatters each gradient but keeps the whole one in param.grad: a second
step() without a backward steps again on the same gradients."""

TASK = "task5_2"
EXPECT = r"a second Zero1Optimizer\.step\(\) with no backward\(\) since the first returned"


class Zero1Optimizer:
    def step(self) -> None:
        missing = [i for i, p in enumerate(self.params) if p.grad is None]
        if missing:
            raise RuntimeError(f"Zero1Optimizer.step(): parameter {missing[0]} (shape "
                               f"{tuple(self.params[missing[0]].shape)}) has no gradient; call "
                               "loss.backward() on every rank before step()")
        for param, shard in zip(self.params, self.shards, strict=True):
            shard.grad = reduce_scatter_mean(param.grad)[: shard.numel()]
        self.optimizer.step()
        for param, shard in zip(self.params, self.shards, strict=True):
            shard.grad = None
            with torch.no_grad():
                param.view(-1).copy_(all_gather_pieces(shard, param.numel()))
