"""Passes non_blocking to Tensor.to but not on to the recursive calls for nested containers."""

TASK = "task0_2"
EXPECT = r"Tensor\.to got non_blocking=.*expected True for every tensor: pass the argument on"


def to_device(batch, device, non_blocking=False):
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return type(batch)((key, to_device(value, device)) for key, value in batch.items())
    if isinstance(batch, (list, tuple)):
        moved = [to_device(item, device) for item in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch
