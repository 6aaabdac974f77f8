"""Registers no hooks and reduce-scatters in step(): ZeRO-1, whole gradients through backward."""

TASK = "task5_3"
EXPECT = r"whole gradients at once during backward"


class Zero2Optimizer:
    def __init__(self, params, optimizer_class=torch.optim.AdamW, **defaults):
        self.params = [p for p in params if p.requires_grad]
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.shards = []
        for param in self.params:
            start, end = shard_bounds(param.numel(), self.world_size, self.rank)
            self.shards.append(param.detach().view(-1)[start:end])
        self.optimizer = optimizer_class(self.shards, **defaults)
        self.handles = []

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
            param.grad = None
        self.optimizer.step()
        for param, shard in zip(self.params, self.shards, strict=True):
            shard.grad = None
            size = shard_size(param.numel(), self.world_size)
            piece = torch.nn.functional.pad(shard, (0, size - shard.numel()))
            whole = torch.empty(self.world_size * size, dtype=param.dtype, device=param.device)
            all_gather_single(whole, piece)
            with torch.no_grad():
                param.view(-1).copy_(whole[: param.numel()])
