"""Never resets the per-bucket ready counters, so no bucket is all-reduced after the first step."""

import torch.distributed as dist

TASK = "task3_5"
EXPECT = r"step 1: .*bucketed gradient vs DDP's.* differ"


class GradientBuckets:
    def wait(self) -> None:
        world_size = dist.get_world_size()
        for index, flat, work in self.pending:
            work.wait()
            flat /= world_size
            offset = 0
            for param in self.buckets[index]:
                count = param.numel()
                param.grad.copy_(flat[offset: offset + count].view_as(param.grad))
                offset += count
        self.pending.clear()
