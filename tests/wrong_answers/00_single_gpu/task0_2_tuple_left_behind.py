"""Handles tensors, dicts and lists but forgets tuples, which stay on the CPU untouched."""

TASK = "task0_2"
EXPECT = r"batch\[0\]: tensor is on cpu, expected it moved to meta"


def to_device(batch, device, non_blocking=False):
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {key: to_device(value, device, non_blocking) for key, value in batch.items()}
    if isinstance(batch, list):
        return [to_device(item, device, non_blocking) for item in batch]
    return batch
