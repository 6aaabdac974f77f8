"""Calls torch.cuda.set_device(local_rank) after init_process_group instead of before it."""

TASK = "task3_2"
EXPECT = r"set_device\(1\) was called after init_process_group"


def setup(backend: str = "auto") -> DistInfo:
    present = [name for name in LAUNCHER_VARIABLES if name in os.environ]
    if not present:
        raise RuntimeError(
            "no launcher environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): "
            "start this script with torchrun --standalone --nproc-per-node=N"
        )
    missing = [name for name in LAUNCHER_VARIABLES if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"the launcher set {present} but not {missing}: start this script with torchrun, "
            "which sets all of them"
        )
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        backend = "nccl" if gpus >= local_world_size else "gloo"
    if backend == "nccl":
        if gpus == 0:
            raise RuntimeError("backend nccl needs CUDA GPUs and none is visible: use gloo")
        if gpus < local_world_size:
            raise RuntimeError(
                f"backend nccl needs one GPU per rank: {local_world_size} ranks on this machine "
                f"but {gpus} GPU(s) visible; start fewer ranks or use gloo"
            )
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method="env://",
                            timeout=datetime.timedelta(seconds=30))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    return DistInfo(rank, local_rank, world_size, local_world_size, backend, device)
