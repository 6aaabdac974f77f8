"""Pitfall 2 · no ``DistributedSampler``: every rank trains on all the data.

Run it: the symptom, then the fix.

    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/02_no_sampler.py
    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/02_no_sampler.py --fix

``DataLoader(dataset, shuffle=True)`` knows nothing about other processes: each rank reads the
whole dataset, so an epoch costs as many steps as on one GPU and every sample is used once per
rank. Adding GPUs then buys nothing. The sampler is the only thing that splits the data; and
``shuffle=True`` next to it is an error, because the sampler does the shuffling.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def demo(fix: bool, dataset_len: int = 12, batch_size: int = 3) -> dict:
    """On this rank: the sample ids one epoch reads, and what shuffle=True next to a sampler
    does."""
    dataset = TensorDataset(torch.arange(dataset_len))
    if fix:
        sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # rank, world from the group
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    else:
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=True)
    seen = [int(i) for (batch,) in loader for i in batch]
    try:
        DataLoader(dataset, batch_size=batch_size, shuffle=True,
                   sampler=DistributedSampler(dataset))
        both = "accepted"
    except ValueError as error:
        both = str(error)
    return {"rank": dist.get_rank(), "seen": seen, "steps": len(loader),
            "shuffle_and_sampler": both}


def summarize(facts: list[dict], fix: bool) -> tuple[bool, str]:
    """(symptom seen?, one-line verdict) from every rank's facts."""
    if len(facts) == 1:
        return False, "NOT SHOWN: one rank has nothing to split; start 2 ranks with torchrun"
    everything = sorted(i for f in facts for i in f["seen"])
    per_rank = [len(f["seen"]) for f in facts]
    distinct = len(set(everything))
    if all(n == distinct for n in per_rank):
        return True, (f"SYMPTOM: each of {len(facts)} ranks read all {distinct} samples "
                      f"({facts[0]['steps']} steps each, as many as one GPU) (rerun with --fix)")
    return False, (f"FIXED: the ranks read {per_rank} samples, {distinct} distinct: "
                   f"{facts[0]['steps']} steps each")


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
    parser.add_argument("--fix", action="store_true", help="shard with a DistributedSampler")
    parser.add_argument("--result", type=Path, help="rank 0 writes the facts here as JSON")
    args = parser.parse_args(argv)
    rank, world_size = setup()
    facts = [None] * world_size
    dist.all_gather_object(facts, demo(args.fix))
    symptom, verdict = summarize(facts, args.fix)
    if rank == 0:  # progress from rank 0 only
        for f in facts:
            print(f"rank {f['rank']} read {sorted(f['seen'])} in {f['steps']} steps")
        print(f"shuffle=True beside a sampler: {facts[0]['shuffle_and_sampler']}")
        print(f"verdict: {verdict}")
        if args.result:
            args.result.write_text(json.dumps({"symptom": symptom, "verdict": verdict,
                                               "ranks": facts}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
