"""All-reduces every whole gradient, then takes this rank's piece: twice the traffic it needs."""

TASK = "task5_2"
EXPECT = r"all-reduced .* reduce_scatter_single gives it exactly that"


class Zero1Optimizer:
    def step(self) -> None:
        for param in self.params:
            if param.grad is None:
                raise RuntimeError("step() before backward()")
        for param, shard in zip(self.params, self.shards, strict=True):
            dist.all_reduce(param.grad)
            start, end = shard_bounds(param.numel(), self.world_size, self.rank)
            shard.grad = param.grad.reshape(-1)[start:end] / self.world_size
        self.optimizer.step()
        for param, shard in zip(self.params, self.shards, strict=True):
            shard.grad = None
            size = shard_size(param.numel(), self.world_size)
            piece = torch.nn.functional.pad(shard, (0, size - shard.numel()))
            whole = torch.empty(self.world_size * size, dtype=param.dtype, device=param.device)
            all_gather_single(whole, piece)
            with torch.no_grad():
                param.view(-1).copy_(whole[: param.numel()])
