"""Pitfall 5 · a collective inside ``if rank == 0:``: the other ranks never come.

Run it: the symptom, then the fix.

    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/05_rank0_collective.py
    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/05_rank0_collective.py --fix

A collective (barrier, all_reduce, broadcast, even an evaluation helper that all-reduces its
metric) completes only when every rank calls it. Put one inside ``if rank == 0:`` and rank 0
waits for partners that have gone on to the next training step, where they wait for rank 0 in
DDP's all-reduce. Both sides wait until the process group's timeout (by default 30 minutes
with gloo, 10 when the backend is "nccl"; this lab sets ``--timeout`` seconds), then fail. The
fix: only the work goes inside the ``if``; the barrier comes after it, called by every rank.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def train_step(model: DDP, optimizer: torch.optim.Optimizer, rank: int) -> None:
    inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))
    optimizer.zero_grad()
    model(inputs).pow(2).mean().backward()  # DDP all-reduces the gradients: every rank must come
    optimizer.step()


def demo(fix: bool, folder: str) -> dict:
    """Train a step, save a checkpoint from rank 0, train another step."""
    rank = dist.get_rank()
    model = DDP(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = Path(folder) / "checkpoint.pt"
    train_step(model, optimizer, rank)
    if fix:
        if rank == 0:
            torch.save(model.module.state_dict(), path)
        dist.barrier()  # every rank: nobody goes on before the file is complete
    else:
        if rank == 0:
            torch.save(model.module.state_dict(), path)
            dist.barrier()  # the mistake: only rank 0 calls it
    train_step(model, optimizer, rank)  # the next step: every rank all-reduces again
    weight = model.module.weight.detach().clone()
    del model, optimizer
    gc.collect()  # free now what only reference cycles hold, before the group goes
    return {"rank": rank, "weight": weight.tolist()}


def summarize(facts: list[dict], fix: bool) -> tuple[bool, str]:
    """(symptom seen?, one-line verdict) from the ranks' facts. After a hang the group is
    broken and no rank can gather the others' facts, so each rank passes its own."""
    for f in facts:
        if f["error"]:
            return True, (f"SYMPTOM: rank {f['rank']} waited {f['waited']:.1f} s for partners "
                          f"that never came, then: {f['error']} (rerun with --fix)")
    if facts[0]["world_size"] == 1:
        return False, "NOT SHOWN: one rank has no partner to miss; start 2 ranks with torchrun"
    return False, "FIXED: every rank passed the barrier and trained on"


def shared_folder() -> str:
    """A temporary folder that rank 0 creates and every rank knows."""
    name = [tempfile.mkdtemp(prefix="lab05-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return name[0]


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
    parser.add_argument("--fix", action="store_true", help="call the barrier on every rank")
    parser.add_argument("--timeout", type=float, default=5.0, help="process-group timeout, s")
    parser.add_argument("--result", type=Path, help="rank 0 writes the outcome here as JSON")
    args = parser.parse_args(argv)
    rank, world_size = setup(timeout=args.timeout)
    folder = shared_folder()
    facts = {"rank": rank, "world_size": world_size, "error": None}
    began = time.monotonic()
    try:
        demo(args.fix, folder)
    except RuntimeError as error:  # this rank waited --timeout seconds, then torch gave up
        facts["error"] = str(error).splitlines()[0].split("] ", 1)[-1]  # without gloo's line
    facts["waited"] = time.monotonic() - began
    gc.collect()
    symptom, verdict = summarize([facts], args.fix)  # after a hang, nobody can gather the rest
    if rank == 0 or symptom:  # normally rank 0 speaks; a rank that failed speaks for itself
        print(f"verdict: {verdict}", flush=True)
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        if args.result:
            args.result.write_text(json.dumps({"symptom": symptom, "verdict": verdict,
                                               "ranks": [facts]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
