"""Only notes readiness in the hooks and all-reduces every bucket in wait(): no overlap at all."""

import torch
import torch.distributed as dist
from torch import nn

TASK = "task3_5"
EXPECT = r"no dist.all_reduce started before backward reached the first layer"


class GradientBuckets:
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        index = self.bucket_of[param]
        self.ready[index] += 1

    def wait(self) -> None:
        world_size = dist.get_world_size()
        for index, bucket in enumerate(self.buckets):
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            self.pending.append((index, flat, dist.all_reduce(flat, async_op=True)))
        for index, flat, work in self.pending:
            work.wait()
            flat /= world_size
            offset = 0
            for param in self.buckets[index]:
                count = param.numel()
                param.grad.copy_(flat[offset: offset + count].view_as(param.grad))
                offset += count
        self.pending.clear()
        self.ready = [0] * len(self.buckets)
