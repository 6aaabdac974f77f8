"""Reads LOCAL_RANK before checking for GPUs: a plain `python script.py` on a CPU machine fails."""

TASK = "task4_2"
EXPECT = r"without GPUs.*check gpu_count == 0 first"


def pick_device(env, gpu_count):
    import torch

    if "LOCAL_RANK" not in env:
        raise RuntimeError("LOCAL_RANK is not set: start the script with torchrun, which sets "
                           "it for every process")
    local_rank = int(env["LOCAL_RANK"])
    if gpu_count == 0:
        return torch.device("cpu")
    if local_rank >= gpu_count:
        raise RuntimeError(f"LOCAL_RANK={local_rank} but this machine has {gpu_count} GPU(s): "
                           f"start at most {gpu_count} processes per machine")
    return torch.device("cuda", local_rank)
