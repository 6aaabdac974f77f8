"""Uses the global RANK as the GPU index instead of LOCAL_RANK."""

TASK = "task4_2"
EXPECT = r"(?i)the GPU index is LOCAL_RANK, never RANK"


def pick_device(env, gpu_count):
    import torch

    if gpu_count == 0:
        return torch.device("cpu")
    if "RANK" not in env:
        raise RuntimeError("RANK is not set: start the script with torchrun")
    rank = int(env["RANK"])
    if rank >= gpu_count:
        raise RuntimeError(f"RANK={rank} but this machine has {gpu_count} GPU(s)")
    return torch.device("cuda", rank)
