"""Flattens the gradients into one tensor and averages it, but never copies the result back."""

TASK = "task3_3"
EXPECT = r"kept its own gradient"


def average_gradients(model):
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
