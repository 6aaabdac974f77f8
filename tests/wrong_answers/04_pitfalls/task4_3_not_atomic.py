"""torch.save straight onto the checkpoint's path: a crash mid-write loses old and new."""

TASK = "task4_3"
EXPECT = r"wrote straight to model.pt.*os.replace"


def save_on_rank0(model, path):
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        torch.save(model.module.state_dict(), path)
    dist.barrier()
