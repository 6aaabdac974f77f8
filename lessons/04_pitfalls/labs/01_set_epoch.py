"""Pitfall 1 · no ``set_epoch``: every epoch reads the same order.

Run it: the symptom, then the fix.

    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/01_set_epoch.py
    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/01_set_epoch.py --fix

``DistributedSampler`` shuffles with a generator seeded with ``seed + epoch``, and it only
learns the epoch from ``sampler.set_epoch(epoch)``. Forget the call and the epoch stays 0:
every epoch replays the first epoch's permutation.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch.distributed as dist
from torch.utils.data import DistributedSampler


def demo(fix: bool, dataset_len: int = 12, epochs: int = 3) -> dict:
    """On this rank: the indices its sampler yields in each epoch."""
    sampler = DistributedSampler(range(dataset_len), shuffle=True, seed=0)  # rank from the group
    orders = []
    for epoch in range(epochs):
        if fix:
            sampler.set_epoch(epoch)  # the fix: a new permutation per epoch, the same on all ranks
        orders.append(list(sampler))
    return {"rank": dist.get_rank(), "orders": orders}


def summarize(facts: list[dict], fix: bool) -> tuple[bool, str]:
    """(symptom seen?, one-line verdict) from every rank's facts."""
    repeated = all(order == f["orders"][0] for f in facts for order in f["orders"])
    if repeated:
        return True, ("SYMPTOM: every epoch read exactly the first epoch's order on every rank "
                      "(rerun with --fix)")
    return False, "FIXED: each epoch read a new order (set_epoch was called before each epoch)"


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
    parser.add_argument("--fix", action="store_true", help="call sampler.set_epoch(epoch)")
    parser.add_argument("--result", type=Path, help="rank 0 writes the facts here as JSON")
    args = parser.parse_args(argv)
    rank, world_size = setup()
    facts = [None] * world_size
    dist.all_gather_object(facts, demo(args.fix))
    symptom, verdict = summarize(facts, args.fix)
    if rank == 0:  # progress from rank 0 only
        for f in facts:
            for epoch, order in enumerate(f["orders"]):
                print(f"rank {f['rank']}  epoch {epoch}: {order}")
        print(f"verdict: {verdict}")
        if args.result:
            args.result.write_text(json.dumps({"symptom": symptom, "verdict": verdict,
                                               "ranks": facts}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
