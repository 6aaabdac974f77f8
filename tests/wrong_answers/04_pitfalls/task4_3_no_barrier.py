"""Rank 0 writes, but nobody waits for it: the other ranks read the previous checkpoint."""

TASK = "task4_3"
EXPECT = r"read the previous checkpoint: every rank must wait at\s+dist.barrier\(\)"


def save_on_rank0(model, path):
    import os
    from pathlib import Path

    import torch
    import torch.distributed as dist

    path = Path(path)
    if dist.get_rank() == 0:
        partial = path.with_name(path.name + ".partial")
        torch.save(model.module.state_dict(), partial)
        os.replace(partial, path)
