"""Never resets the per-bucket ready counters, so no bucket is all-reduced after the first step."""

import torch
import torch.distributed as dist
from torch import nn

TASK = "task3_5"
EXPECT = r"step 1: .*bucketed gradient vs DDP's.* differ"


class GradientBuckets:
    def __init__(self, model: nn.Module, bucket_size: int = 2**20):
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets: list[list[nn.Parameter]] = []
        current: list[nn.Parameter] = []
        size = 0
        for param in reversed(params):
            if current and size + param.numel() > bucket_size:
                self.buckets.append(current)
                current, size = [], 0
            current.append(param)
            size += param.numel()
        if current:
            self.buckets.append(current)
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)
        self.pending: list[tuple[int, torch.Tensor, dist.Work]] = []
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                        for p in params]

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        index = self.bucket_of[param]
        self.ready[index] += 1
        if self.ready[index] == len(self.buckets[index]):
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[index]])
            work = dist.all_reduce(flat, async_op=True)
            self.pending.append((index, flat, work))

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

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
