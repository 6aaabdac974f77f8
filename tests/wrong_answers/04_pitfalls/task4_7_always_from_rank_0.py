"""Ignores src and always broadcasts from rank 0."""

TASK = "task4_7"
EXPECT = r"after broadcasting from rank 1: .*differ"


def broadcast_initial_state(model, src=0):
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)
