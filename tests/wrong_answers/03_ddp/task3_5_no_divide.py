"""Sums the buckets over the ranks but never divides by the world size."""

import torch.distributed as dist

TASK = "task3_5"
EXPECT = r"bucketed gradient vs DDP's.* differ"


class GradientBuckets:
    def wait(self) -> None:
        world_size = dist.get_world_size()
        for index, flat, work in self.pending:
            work.wait()
            offset = 0
            for param in self.buckets[index]:
                count = param.numel()
                param.grad.copy_(flat[offset: offset + count].view_as(param.grad))
                offset += count
        self.pending.clear()
        self.ready = [0] * len(self.buckets)
