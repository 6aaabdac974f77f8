"""Rebuilds every list or tuple as a list, so (inputs, targets) comes back as [inputs, targets]."""

TASK = "task0_2"
EXPECT = r"got a list, expected a tuple \(keep each container's type\)"


def to_device(batch, device, non_blocking=False):
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {key: to_device(value, device, non_blocking) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return [to_device(item, device, non_blocking) for item in batch]
    return batch
