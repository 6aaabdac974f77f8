"""Writes the temporary file in the system's temp folder, where os.replace may not be atomic."""

TASK = "task4_3"
EXPECT = r"os.replace is only\s+atomic within one file system"


def save_on_rank0(model, path):
    import os
    import tempfile

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        handle, partial = tempfile.mkstemp(suffix=".pt")
        os.close(handle)
        torch.save(model.module.state_dict(), partial)
        os.replace(partial, path)
    dist.barrier()
