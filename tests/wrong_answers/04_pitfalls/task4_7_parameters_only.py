"""Broadcasts the parameters but not the buffers (BatchNorm's running statistics)."""

TASK = "task4_7"
EXPECT = r"buffer 1\.running_mean after broadcasting"


def broadcast_initial_state(model, src=0):
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        for param in model.parameters():
            dist.broadcast(param, src=src)
