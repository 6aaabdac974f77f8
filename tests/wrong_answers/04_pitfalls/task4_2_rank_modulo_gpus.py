"""Takes RANK % gpu_count: right only when every machine runs exactly one process per GPU."""

TASK = "task4_2"
EXPECT = r"got cuda:2, expected cuda:0: the GPU index is LOCAL_RANK, never RANK"


def pick_device(env, gpu_count):
    import torch

    if gpu_count == 0:
        return torch.device("cpu")
    return torch.device("cuda", int(env["RANK"]) % gpu_count)
