"""Puts dist.barrier() inside `if rank == 0`: rank 0 waits for ranks that never call it."""

TASK = "task4_3"
EXPECT = r"is\s+dist.barrier\(\) inside `if rank == 0`\?"


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
        dist.barrier()
