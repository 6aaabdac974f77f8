"""Every rank saves the checkpoint (atomically, to the same path), not only rank 0."""

TASK = "task4_3"
EXPECT = r"only rank 0 should write"


def save_on_rank0(model, path):
    import os
    from pathlib import Path

    import torch
    import torch.distributed as dist

    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    torch.save(model.module.state_dict(), partial)
    os.replace(partial, path)
    dist.barrier()
