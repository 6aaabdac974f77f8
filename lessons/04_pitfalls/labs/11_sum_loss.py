"""Pitfall 11 · ``reduction="sum"``: the step size changes with the number of GPUs.

Run it: the symptom, then the fix.

    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/11_sum_loss.py
    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/11_sum_loss.py --fix

DDP *averages* gradients over ranks. With a mean loss, the average of W per-rank means is the
mean over the global batch: the gradient one GPU computes on all W x b samples. With a summed
loss, the average of W per-rank sums is 1/W of the global sum: add GPUs and every step gets
smaller, as if the learning rate were divided by W. Use mean losses (or scale by W, knowingly).
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


def shard(rank: int, per_rank: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(per_rank, 4, generator=generator), torch.randn(per_rank, 1,
                                                                      generator=generator)


def demo(fix: bool) -> dict:
    """On this rank: DDP's gradient divided by one process's gradient on the global batch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    reduction = "mean" if fix else "sum"
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    inputs, targets = shard(rank)
    nn.functional.mse_loss(model(inputs), targets, reduction=reduction).backward()
    ddp_gradient = model.module.weight.grad.clone()
    torch.manual_seed(0)
    single = nn.Linear(4, 1)  # one process, every rank's samples, the same loss
    parts = [shard(r) for r in range(world_size)]
    everything = torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])
    nn.functional.mse_loss(single(everything[0]), everything[1], reduction=reduction).backward()
    ratio = (ddp_gradient / single.weight.grad).mean().item()
    del model
    gc.collect()  # free now what only reference cycles hold, before the group goes
    return {"rank": rank, "world_size": world_size, "reduction": reduction, "ratio": ratio}


def summarize(facts: list[dict], fix: bool) -> tuple[bool, str]:
    """(symptom seen?, one-line verdict) from every rank's facts."""
    f = facts[0]
    what = (f"reduction={f['reduction']!r} on {f['world_size']} rank(s): DDP's gradient is "
            f"{f['ratio']:.4f} x one GPU's on the same global batch")
    if abs(f["ratio"] - 1) > 1e-4:
        return True, f"SYMPTOM: {what} (rerun with --fix)"
    if f["world_size"] == 1:
        return False, f"NOT SHOWN: {what}; start 2 ranks with torchrun"
    return False, f"FIXED: {what}"


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
    parser.add_argument("--fix", action="store_true", help="use reduction='mean'")
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
