"""Calls dist.all_reduce without async_op=True in the hook: backward stops for every bucket."""

import torch
import torch.distributed as dist
from torch import nn

TASK = "task3_5"
EXPECT = r"without async_op=True"


class GradientBuckets:
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        index = self.bucket_of[param]
        self.ready[index] += 1
        if self.ready[index] == len(self.buckets[index]):
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[index]])
            dist.all_reduce(flat)
            self.pending.append((index, flat, None))

    def wait(self) -> None:
        world_size = dist.get_world_size()
        for index, flat, _ in self.pending:  # already all-reduced
            flat /= world_size
            offset = 0
            for param in self.buckets[index]:
                count = param.numel()
                param.grad.copy_(flat[offset: offset + count].view_as(param.grad))
                offset += count
        self.pending.clear()
        self.ready = [0] * len(self.buckets)
