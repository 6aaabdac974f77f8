"""Data-parallel training with DistributedDataParallel: one script for every way of starting it.

    python lessons/03_ddp/train_ddp.py                                   # 1 process, no launcher
    torchrun --standalone --nproc-per-node=2 lessons/03_ddp/train_ddp.py  # 2 processes
    python -m torch.distributed.launch --nproc-per-node=2 lessons/03_ddp/train_ddp.py  # old way

Each process trains a full copy of the model on its own shard of every batch
(``DistributedSampler``); DDP averages the gradients during backward, so every copy takes the
same step. ``--batch-size`` is per process: the global batch is ``world size x batch size``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--samples", type=int, default=480, help="size of the training set")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    parser.add_argument("--checkpoint", type=Path, help="rank 0 saves the model here")
    parser.add_argument("--result", type=Path, help="rank 0 writes a JSON summary here")
    # torch.distributed.launch passes --local-rank=N (before torch 2.0: --local_rank=N).
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None)
    return parser.parse_args(argv)


def fail(message: str) -> None:
    """A clear one-line error instead of a traceback from deep inside torch."""
    print(f"train_ddp.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def setup(args) -> tuple[int, int, int, str, torch.device]:
    """Join the process group the launcher described; returns rank, local rank, world size,
    backend and device. Without any launcher, run as a group of one."""
    present = [name for name in LAUNCHER_VARIABLES if name in os.environ]
    if not present:
        # Plain `python train_ddp.py`: a one-process group, so the same DDP code path runs.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    else:
        if args.local_rank is not None and "LOCAL_RANK" not in os.environ:
            os.environ["LOCAL_RANK"] = str(args.local_rank)  # very old launchers
        missing = [name for name in LAUNCHER_VARIABLES if name not in os.environ]
        if missing:
            fail(f"the launcher set {present} but not {missing}; "
                 "start with: torchrun --standalone --nproc-per-node=N train_ddp.py")
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = args.backend
    if backend == "auto":  # nccl only when every rank on this machine has a GPU of its own
        backend = "nccl" if gpus >= local_world_size else "gloo"
    if backend == "nccl":
        if gpus == 0:
            fail("--backend nccl needs CUDA GPUs, and none is visible; use --backend gloo")
        if gpus < local_world_size:
            fail(f"--backend nccl needs one GPU per process: {local_world_size} processes on "
                 f"this machine, {gpus} GPU(s) visible. Start at most {gpus} or use gloo")
        torch.cuda.set_device(local_rank)  # before anything else touches CUDA
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    timeout = datetime.timedelta(seconds=60)  # a missing peer becomes an error, not a hang
    if present:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:  # a store on port 0: the OS picks a free port, nothing to configure
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    return rank, local_rank, world_size, backend, device


def make_dataset(samples: int, seed: int) -> TensorDataset:
    """A regression task from a fixed random "teacher": the same data in every process."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, 8, generator=generator)
    teacher = torch.randn(8, 1, generator=generator)
    targets = torch.tanh(inputs @ teacher) + 0.05 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(inputs, targets)


def build_model(seed: int) -> nn.Module:
    # Same seed everywhere; DDP would broadcast rank 0's weights anyway.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def parameter_digest(model: nn.Module) -> str:
    """sha256 of every parameter and buffer's name, dtype, shape and exact bytes."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        digest.update(bytes(t.reshape(-1).view(torch.uint8).tolist()))
    return digest.hexdigest()


def save_checkpoint(model: DDP, path: Path, rank: int) -> None:
    """Rank 0 writes (to a temporary name, then renames: a crash never leaves half a file);
    everyone waits at the barrier so no rank reads the file before it is complete."""
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        torch.save(model.module.state_dict(), partial)  # .module: no "module." prefixes
        os.replace(partial, path)
    dist.barrier()


def main(argv=None) -> dict:
    args = parse_args(argv)
    rank, local_rank, world_size, backend, device = setup(args)
    log = print if rank == 0 else (lambda *a, **k: None)  # progress from rank 0 only
    log(f"world size {world_size}, backend {backend}, device {device} "
        f"(global batch {world_size} x {args.batch_size})")

    dataset = make_dataset(args.samples, args.seed)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)  # rank, world from group
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        pin_memory=device.type == "cuda")
    model = DDP(build_model(args.seed).to(device),
                device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()

    losses = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, samples
        start = time.perf_counter()
        for inputs, targets in loader:
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(inputs), targets)
            loss.backward()  # DDP all-reduces gradient buckets as they become ready
            optimizer.step()
            # Summed on the device: no .item() and no new host tensor, so no wait for the GPU.
            totals[0] += loss.detach().double() * len(inputs)
            totals[1] += len(inputs)
        dist.all_reduce(totals)  # the loss of the whole epoch, over every rank
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        losses.append((totals[0] / totals[1]).item())
        log(f"epoch {epoch}  loss {losses[-1]:.5f}  {totals[1].item() / seconds:,.0f} samples/s")

    if args.checkpoint:
        save_checkpoint(model, args.checkpoint, rank)
        log(f"checkpoint saved to {args.checkpoint}")
    result = {
        "world_size": world_size,
        "backend": backend,
        "device": str(device),
        "global_batch": world_size * args.batch_size,
        "losses": losses,
        "digest": parameter_digest(model.module),
        "parameters": {k: v.cpu().tolist() for k, v in model.module.state_dict().items()},
    }
    if rank == 0 and args.result:
        args.result.write_text(json.dumps(result))
    # DDP keeps the process group alive through reference cycles. Free it before destroying
    # the group, or the group's threads may die with the interpreter ("terminate called
    # without an active exception", seen here in about 4 runs in 10 without this).
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
