"""Pitfall 7 · parameters unused in forward: "Expected to have finished reduction ...".

Run it: the symptom, then the fix.

    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/07_unused_parameters.py
    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/07_unused_parameters.py --fix

DDP all-reduces a bucket of gradients once every parameter in it has its gradient. A
parameter that took no part in the loss (a head used only for some batches, a layer left in
``__init__``) never gets one, so its bucket never finishes; DDP notices at the next forward
and raises. Fixes, cheapest first:

- remove the unused parameters, or freeze them (``requires_grad_(False)``) before wrapping;
- ``DDP(model, static_graph=True)`` when the same parameters go unused in every step: DDP
  learns the set in the first step;
- ``DDP(model, find_unused_parameters=True)`` when the set changes from step to step: after
  every forward DDP walks the autograd graph from the outputs to find the unused parameters,
  which costs time on every step (the lab measures it).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class TwoHeads(nn.Module):
    """A shared body with a main head and an auxiliary head that this training never uses."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU())
        self.head = nn.Linear(64, 1)
        self.aux_head = nn.Linear(64, 1)  # e.g. used only when an auxiliary loss is on

    def forward(self, x, use_aux: bool = False):
        features = self.body(x)
        return self.aux_head(features) if use_aux else self.head(features)


def train(steps: int, freeze_aux: bool = False, **ddp_options) -> tuple[float, list[float]]:
    """Train ``steps`` steps; return seconds per step and the head's first weights."""
    torch.manual_seed(0)
    model = TwoHeads()
    if freeze_aux:
        model.aux_head.requires_grad_(False)  # DDP only waits for parameters that need grads
    model = DDP(model, **ddp_options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(dist.get_rank())
    began = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(32, 16, generator=generator)).pow(2).mean().backward()
        optimizer.step()
    seconds = (time.perf_counter() - began) / steps
    weights = model.module.head.weight[0, :4].tolist()
    del model, optimizer
    gc.collect()  # free now what only reference cycles hold, before the group goes
    return seconds, weights


FIXES = ("freeze_aux", "static_graph", "find_unused_parameters")


def demo(fix: bool, steps: int = 20) -> dict:
    """On this rank: the error plain DDP raises, or each fix's time per step and weights."""
    facts = {"rank": dist.get_rank()}
    if not fix:
        try:
            train(steps)
            facts["error"] = None
        except RuntimeError as error:  # raised on every rank at the 2nd forward: no hang
            facts["error"] = str(error)
        return facts
    for option in FIXES:
        facts[option] = train(steps, **{option: True})
    return facts


def summarize(facts: list[dict], fix: bool) -> tuple[bool, str]:
    """(symptom seen?, one-line verdict) from every rank's facts."""
    if not fix:
        error = facts[0]["error"]
        if error:
            return True, f"SYMPTOM: {error.split('. ')[0]} (rerun with --fix)"
        return False, "NOT SHOWN: plain DDP trained without an error"
    weights = {tuple(f[option][1]) for f in facts for option in FIXES}
    if len(weights) == 1:
        return False, "FIXED: each fix trains, to the same weights on every rank"
    return True, "NOT FIXED: the fixes or the ranks disagree"


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
    parser.add_argument("--fix", action="store_true", help="time each fix")
    parser.add_argument("--steps", type=int, default=100, help="training steps per variant")
    parser.add_argument("--result", type=Path, help="rank 0 writes the facts here as JSON")
    args = parser.parse_args(argv)
    rank, world_size = setup()
    facts = [None] * world_size
    dist.all_gather_object(facts, demo(args.fix, args.steps))
    symptom, verdict = summarize(facts, args.fix)
    if rank == 0:  # progress from rank 0 only
        if args.fix:
            for option in FIXES:
                print(f"{option}=True: {facts[0][option][0] * 1e3:.2f} ms per step")
        print(f"verdict: {verdict}")
        if args.result:
            args.result.write_text(json.dumps({"symptom": symptom, "verdict": verdict,
                                               "ranks": facts}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
