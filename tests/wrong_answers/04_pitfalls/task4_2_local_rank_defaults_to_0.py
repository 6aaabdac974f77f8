"""Silently uses cuda:0 when LOCAL_RANK is missing, instead of saying torchrun sets it."""

TASK = "task4_2"
EXPECT = r"expected a RuntimeError: LOCAL_RANK is missing"


def pick_device(env, gpu_count):
    import torch

    if gpu_count == 0:
        return torch.device("cpu")
    local_rank = int(env.get("LOCAL_RANK", 0))
    if local_rank >= gpu_count:
        raise RuntimeError(f"LOCAL_RANK={local_rank} but this machine has {gpu_count} GPU(s): "
                           f"start at most {gpu_count} processes per machine")
    return torch.device("cuda", local_rank)
