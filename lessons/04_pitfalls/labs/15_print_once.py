"""Pitfall 15 · printing from every rank: N copies of every line, interleaved.

Run it: the symptom, then the fix.

    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/15_print_once.py
    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/15_print_once.py --fix

Every rank runs the whole script, so every ``print`` runs W times, and the copies interleave
in whatever order the processes reach them. Progress and metrics belong to rank 0; compute a
metric over all ranks first (all-reduce), then let rank 0 print it. Per-rank information
(an error, a rank's own device) is the exception: tag it with the rank. With torchrun,
``--tee 3`` prefixes each line with the *local* rank (``[default0]:``, the same on every
machine; ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank${rank}]:'`` makes it the global rank),
and ``--local-ranks-filter 0`` shows only local rank 0 on each machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def demo(fix: bool, steps: int = 3) -> dict:
    """Train a few pretend steps and report progress; returns the lines this rank printed."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    printed = []

    def say(text: str) -> None:
        printed.append(text)
        print(text, flush=True)

    log = say if rank == 0 or not fix else (lambda text: None)  # the fix: rank 0 only
    generator = torch.Generator().manual_seed(rank)
    for step in range(steps):
        loss = torch.rand(1, generator=generator)
        if fix:
            dist.all_reduce(loss)  # the metric of all ranks, not of the one that prints
            loss /= world_size
        log(f"step {step}  loss {loss.item():.4f}")
    return {"rank": rank, "printed": printed}


def summarize(facts: list[dict], fix: bool) -> tuple[bool, str]:
    """(symptom seen?, one-line verdict) from every rank's facts."""
    if len(facts) == 1:
        return False, "NOT SHOWN: one rank prints once anyway; start 2 ranks with torchrun"
    speakers = [f["rank"] for f in facts if f["printed"]]
    lines = sum(len(f["printed"]) for f in facts)
    if len(speakers) > 1:
        return True, (f"SYMPTOM: ranks {speakers} each printed their own progress: {lines} "
                      f"lines for {len(facts[0]['printed'])} steps (rerun with --fix)")
    return False, f"FIXED: only rank 0 printed, {lines} lines with the loss of all ranks"


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
    parser.add_argument("--fix", action="store_true", help="print progress from rank 0 only")
    parser.add_argument("--result", type=Path, help="rank 0 writes the facts here as JSON")
    args = parser.parse_args(argv)
    rank, world_size = setup()
    facts = [None] * world_size
    dist.all_gather_object(facts, demo(args.fix))
    symptom, verdict = summarize(facts, args.fix)
    if rank == 0:
        print(f"verdict: {verdict}")
        if args.result:
            args.result.write_text(json.dumps({"symptom": symptom, "verdict": verdict,
                                               "ranks": facts}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
