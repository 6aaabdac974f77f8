"""Averages whole gradients and steps whole parameters: DDP by hand, AdamW's state unsharded."""

import torch.distributed as dist

TASK = "task5_2"
EXPECT = r"that is state for every element"


class Zero1Optimizer:
    def __init__(self, params, optimizer_class=torch.optim.AdamW, **defaults):
        self.params = [p for p in params if p.requires_grad]
        self.world_size = dist.get_world_size()
        self.optimizer = optimizer_class(self.params, **defaults)

    def step(self) -> None:
        for param in self.params:
            if param.grad is None:
                raise RuntimeError("step() before backward()")
            dist.all_reduce(param.grad)
            param.grad /= self.world_size
        self.optimizer.step()
