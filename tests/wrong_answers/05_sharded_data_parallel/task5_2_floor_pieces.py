"""Cuts numel // world_size elements per rank: the elements left over belong to nobody."""

TASK = "task5_2"
EXPECT = r"belong to no rank"


class Zero1Optimizer:
    def __init__(self, params, optimizer_class=torch.optim.AdamW, **defaults):
        self.params = [p for p in params if p.requires_grad]
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self.shards = []
        for param in self.params:
            size = param.numel() // self.world_size
            self.shards.append(param.detach().view(-1)[self.rank * size:(self.rank + 1) * size])
        self.optimizer = optimizer_class(self.shards, **defaults)

    def step(self) -> None:
        for param in self.params:
            if param.grad is None:
                raise RuntimeError("step() before backward()")
        for param, shard in zip(self.params, self.shards, strict=True):
            size = param.numel() // self.world_size
            mine = torch.empty(size)
            reduce_scatter_single(mine, param.grad.reshape(-1)[: self.world_size * size])
            shard.grad = mine / self.world_size
        self.optimizer.step()
        for param, shard in zip(self.params, self.shards, strict=True):
            shard.grad = None
            size = param.numel() // self.world_size
            whole = torch.empty(self.world_size * size)
            all_gather_single(whole, shard.contiguous())
            with torch.no_grad():
                param.view(-1)[: self.world_size * size].copy_(whole)
