"""Keeps only the tensors of a dict, dropping keys whose values are strings, numbers or None."""

TASK = "task0_2"
EXPECT = r"batch\[.*\]: keys .*, expected .* \(all of them, in order\)"


def to_device(batch, device, non_blocking=False):
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {key: to_device(value, device, non_blocking) for key, value in batch.items()
                if isinstance(value, (torch.Tensor, dict, list, tuple))}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(item, device, non_blocking) for item in batch)
    return batch
