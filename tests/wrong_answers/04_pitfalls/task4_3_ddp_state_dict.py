"""Saves the DDP wrapper's state_dict, whose keys all start with 'module.'."""

TASK = "task4_3"
EXPECT = r"save model.module.state_dict\(\), not the DDP's"


def save_on_rank0(model, path):
    import os
    from pathlib import Path

    import torch
    import torch.distributed as dist

    path = Path(path)
    if dist.get_rank() == 0:
        partial = path.with_name(path.name + ".partial")
        torch.save(model.state_dict(), partial)
        os.replace(partial, path)
    dist.barrier()
