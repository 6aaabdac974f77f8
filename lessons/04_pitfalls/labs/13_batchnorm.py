"""Pitfall 13 · BatchNorm under DDP: statistics per rank, not over the global batch.

Run it: the symptom, then the fix (the fix needs one CUDA GPU per rank).

    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/13_batchnorm.py
    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/13_batchnorm.py --fix

Each rank's ``BatchNorm`` normalises with the mean and variance of *its own* b samples, and
updates its own running statistics. So DDP is no longer "one GPU with batch W x b": the
gradients differ, small per-rank batches give noisy statistics, and the running statistics
differ between ranks (DDP copies rank 0's buffers to the others at each forward, so the
saved model keeps statistics of rank 0's data only). ``nn.SyncBatchNorm`` computes the
statistics over all ranks at every training forward; it needs accelerator tensors (CUDA or
XPU, for example): on a CPU it raises.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


def shard(rank: int) -> torch.Tensor:
    """This rank's inputs: each rank's data has a different mean, as real shards may."""
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(rank)) + 2.0 * rank


def demo(fix: bool) -> dict:
    """One training forward and backward; compare with one process on the global batch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    on_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    model = make_model()
    if fix:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if not on_gpu:
            try:
                model(shard(rank))  # a training forward on the CPU
            except ValueError as error:
                return {"rank": rank, "skipped": f"SyncBatchNorm needs GPU tensors: on a CPU it "
                                                  f"raises ({error}); run on one GPU per rank"}
    torch.backends.cuda.matmul.allow_tf32 = False  # compared with a CPU run: full fp32
    model = DDP(model.to(device), device_ids=[device.index] if on_gpu else None)
    model(shard(rank).to(device)).pow(2).mean().backward()
    running_mean = model.module[1].running_mean.cpu()
    gradient = model.module[0].weight.grad.cpu()
    reference = make_model()  # one process, one batch of every rank's samples
    reference(torch.cat([shard(r) for r in range(world_size)])).pow(2).mean().backward()
    del model
    gc.collect()  # free now what only reference cycles hold, before the group goes
    return {"rank": rank, "running_mean": running_mean.tolist(),
            "running_mean_gap": (running_mean - reference[1].running_mean).abs().max().item(),
            "gradient_gap": (gradient - reference[0].weight.grad).abs().max().item()}


def summarize(facts: list[dict], fix: bool) -> tuple[bool, str]:
    """(symptom seen?, one-line verdict) from every rank's facts."""
    if "skipped" in facts[0]:
        return False, f"NOT SHOWN: {facts[0]['skipped']}"
    if len(facts) == 1:
        return False, "NOT SHOWN: one rank is the whole batch; start 2 ranks with torchrun"
    spread = max(abs(a - b) for f in facts
                 for a, b in zip(f["running_mean"], facts[0]["running_mean"], strict=True))
    gap = max(f["gradient_gap"] for f in facts)
    what = (f"running means differ across ranks by up to {spread:.3g}; the gradient differs "
            f"from one process on the global batch by up to {gap:.3g}")
    if spread > 1e-5 or gap > 1e-4:
        return True, f"SYMPTOM: {what} (rerun with --fix on GPUs)"
    return False, f"FIXED: {what}"


def backend_for_this_machine() -> str:
    """nccl when every rank on this machine has a GPU of its own (SyncBatchNorm needs it), else
    gloo. For nccl it sets this process's GPU first, before anything else touches CUDA."""
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < local_world_size:
        return "gloo"
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return "nccl"


def setup(backend: str = "gloo", timeout: float = 30.0) -> tuple[int, int]:
    """Join the group torchrun describes, or make a group of one under plain python.

    Every lab carries this same function, so that each file runs on its own (a test keeps the
    copies identical). ``backend``: gloo runs anywhere; lab 13 asks for nccl when every rank
    has a GPU. ``timeout``, in seconds: how long a collective waits before torch raises an
    error; labs 05 and 06 shorten it to show a hang.

    torch.distributed.nn is imported here, before the group exists, on purpose: DDP imports it
    on first use, and its functions then keep the group as a default argument, so
    destroy_process_group cannot free it and the process may abort at exit ("terminate called
    without an active exception")."""
    import torch.distributed.nn  # noqa: F401

    limit = datetime.timedelta(seconds=timeout)  # a hang becomes an error after this long
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=limit)
    else:
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=limit)
    return dist.get_rank(), dist.get_world_size()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fix", action="store_true", help="use SyncBatchNorm (GPUs only)")
    parser.add_argument("--result", type=Path, help="rank 0 writes the facts here as JSON")
    args = parser.parse_args(argv)
    rank, world_size = setup(backend_for_this_machine())
    facts = [None] * world_size
    dist.all_gather_object(facts, demo(args.fix))
    symptom, verdict = summarize(facts, args.fix)
    if rank == 0:  # progress from rank 0 only
        for f in facts:
            if "running_mean" in f:
                print(f"rank {f['rank']}: running mean {[round(v, 3) for v in f['running_mean']]}")
        print(f"verdict: {verdict}")
        if args.result:
            args.result.write_text(json.dumps({"symptom": symptom, "verdict": verdict,
                                               "ranks": facts}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
