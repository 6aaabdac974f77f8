"""Pitfall 8 · ``model.module(x)`` instead of ``model(x)``: gradients silently stop syncing.

Run it: the symptom, then the fix.

    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/08_module_forward.py
    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/08_module_forward.py --fix

DDP arms its gradient all-reduce in its own ``forward``: calling the wrapped module directly
skips that, so backward computes this rank's gradients and nothing averages them. No error,
no warning: each rank steps with its own gradients and the copies drift apart. (Using
``model.module`` is right for what is not training: saving its ``state_dict``, or calling a
method that is not ``forward`` under ``torch.no_grad()``.)
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


def demo(fix: bool, steps: int = 3) -> dict:
    """On this rank: the first step's gradient and the weights after ``steps`` steps."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)  # each rank its own data, as with a sampler
    gradients = []
    for _ in range(steps):
        inputs = torch.randn(8, 4, generator=generator)
        optimizer.zero_grad()
        outputs = model(inputs) if fix else model.module(inputs)  # the mistake: bypasses DDP
        outputs.pow(2).mean().backward()
        gradients.append(model.module.weight.grad[0].tolist())
        optimizer.step()
    weight = model.module.weight[0].tolist()
    del model, optimizer
    gc.collect()  # free now what only reference cycles hold, before the group goes
    return {"rank": rank, "first_gradient": gradients[0], "weight": weight}


def summarize(facts: list[dict], fix: bool) -> tuple[bool, str]:
    """(symptom seen?, one-line verdict) from every rank's facts."""
    if len(facts) == 1:
        return False, "NOT SHOWN: one rank has nobody to disagree with; start 2 with torchrun"
    gap = max(abs(a - b) for f in facts for a, b in zip(f["weight"], facts[0]["weight"],
                                                          strict=True))
    if gap > 1e-6:
        return True, (f"SYMPTOM: no error, but the ranks' weights differ by up to {gap:.3g} "
                      f"(rerun with --fix)")
    return False, "FIXED: every rank holds the same weights"


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
    parser.add_argument("--fix", action="store_true", help="call model(x), not model.module(x)")
    parser.add_argument("--result", type=Path, help="rank 0 writes the facts here as JSON")
    args = parser.parse_args(argv)
    rank, world_size = setup()
    facts = [None] * world_size
    dist.all_gather_object(facts, demo(args.fix))
    symptom, verdict = summarize(facts, args.fix)
    if rank == 0:  # progress from rank 0 only
        for f in facts:
            print(f"rank {f['rank']}: first gradient {[round(g, 4) for g in f['first_gradient']]}"
                  f", weight after training {[round(w, 4) for w in f['weight']]}")
        print(f"verdict: {verdict}")
        if args.result:
            args.result.write_text(json.dumps({"symptom": symptom, "verdict": verdict,
                                               "ranks": facts}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
