"""Pitfall 10 · gradient accumulation without ``no_sync``: an all-reduce on every micro-step.

Run it: the symptom, then the fix.

    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/10_no_sync.py
    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/10_no_sync.py --fix

To step once per k micro-batches you call backward k times and let the gradients add up. Under
DDP every backward also all-reduces every gradient, so k micro-steps cost k rounds of
communication where one would do: all-reduce is linear, so averaging the sum once gives the
same result as summing k averages. ``with model.no_sync():`` turns the all-reduce off for the
micro-steps inside it; the last micro-step runs outside it and syncs the accumulated sum.

The forward belongs inside ``no_sync()`` too, not only ``backward()``: DDP reads the flag that
``no_sync()`` clears in its *forward*, and a forward run with the flag set arms the all-reduce
of the backward that follows, wherever that backward runs. With ``--fix`` the lab also runs
that half-fix (only ``backward()`` inside ``no_sync()``) and counts its all-reduces.

A communication hook (``model.register_comm_hook``) counts what DDP all-reduces. Either way,
with each micro-batch's loss divided by k, the accumulated gradient equals the gradient of
one batch of all k x world-size micro-batches.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def micro_batches(rank: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator))
            for _ in range(k)]


def counting_hook(counter: dict):
    """A DDP comm hook: count the gradient elements each all-reduce carries, then all-reduce."""
    def hook(state, bucket):
        counter["buckets"] += 1
        counter["elements"] += bucket.buffer().numel()
        return default_hooks.allreduce_hook(state, bucket)
    return hook


def accumulate(model: DDP, batches, variant: str) -> None:
    """Accumulate the micro-batches' gradients the way ``variant`` says."""
    k = len(batches)
    for step, (inputs, targets) in enumerate(batches):
        quiet = variant != "plain" and step < k - 1  # all but the last micro-step
        if variant == "backward only":  # the half-fix: the forward runs outside no_sync()
            loss = nn.functional.mse_loss(model(inputs), targets) / k
            with model.no_sync() if quiet else contextlib.nullcontext():
                loss.backward()
            continue
        with model.no_sync() if quiet else contextlib.nullcontext():
            loss = nn.functional.mse_loss(model(inputs), targets) / k  # mean over micro-steps
            loss.backward()


def measure(variant: str, k: int) -> dict:
    """Accumulate k micro-batches on this rank; count the all-reduces; check the gradient."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = DDP(make_model())
    counter = {"buckets": 0, "elements": 0}
    model.register_comm_hook(None, counting_hook(counter))  # None: the default group
    accumulate(model, micro_batches(rank, k), variant)
    gradients = {name: p.grad.clone() for name, p in model.module.named_parameters()}
    # One process, one batch holding every rank's micro-batches: what accumulation must equal.
    reference = make_model()
    everything = [b for r in range(world_size) for b in micro_batches(r, k)]
    inputs, targets = (torch.cat(parts) for parts in zip(*everything, strict=True))
    nn.functional.mse_loss(reference(inputs), targets).backward()
    gap = max((gradients[n] - p.grad).abs().max().item() for n, p in reference.named_parameters())
    parameters = sum(p.numel() for p in model.parameters())
    del model
    gc.collect()  # free now what only reference cycles hold, before the group goes
    return {"bucket_all_reduces": counter["buckets"],
            "sync_rounds": counter["elements"] / parameters, "gap_to_full_batch": gap}


def demo(fix: bool, k: int = 4) -> dict:
    """Without the fix, no no_sync(); with it, no_sync() around the forward and backward of
    all but the last micro-step, and, for comparison, around only their backward."""
    facts = {"rank": dist.get_rank(), "micro_steps": k,
             **measure("no_sync" if fix else "plain", k)}
    if fix:
        facts["backward_only"] = measure("backward only", k)
    return facts


def summarize(facts: list[dict], fix: bool) -> tuple[bool, str]:
    """(symptom seen?, one-line verdict) from every rank's facts."""
    f = facts[0]
    gap = max(g["gap_to_full_batch"] for g in facts)
    what = (f"every gradient was all-reduced {f['sync_rounds']:g} time(s) "
            f"({f['bucket_all_reduces']} bucket all-reduces) in {f['micro_steps']} micro-steps; "
            f"the gradient equals the full batch's to {gap:.1g}")
    if f["sync_rounds"] > 1:
        return True, f"SYMPTOM: {what} (rerun with --fix)"
    half = f["backward_only"]
    return False, (f"FIXED: {what}. With only backward() inside no_sync() (the forward outside): "
                   f"{half['sync_rounds']:g} time(s) ({half['bucket_all_reduces']} bucket "
                   f"all-reduces)")


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
    parser.add_argument("--fix", action="store_true",
                        help="no_sync() around all but the last micro-step")
    parser.add_argument("--result", type=Path, help="rank 0 writes the facts here as JSON")
    args = parser.parse_args(argv)
    rank, world_size = setup()
    facts = [None] * world_size
    dist.all_gather_object(facts, demo(args.fix))
    symptom, verdict = summarize(facts, args.fix)
    if rank == 0:  # progress from rank 0 only
        print(f"verdict: {verdict}")
        if args.result:
            args.result.write_text(json.dumps({"symptom": symptom, "verdict": verdict,
                                               "ranks": facts}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
