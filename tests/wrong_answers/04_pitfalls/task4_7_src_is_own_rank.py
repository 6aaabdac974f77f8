"""Broadcasts from each rank's own rank instead of from src."""

TASK = "task4_7"
EXPECT = r"every rank must call dist.broadcast with the same src"


def broadcast_initial_state(model, src=0):
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=dist.get_rank())
