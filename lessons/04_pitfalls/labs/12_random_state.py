"""Pitfall 12 · random state: the same "random" augmentation everywhere, or models that differ.

Run it: the symptoms, then the fixes.

    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/12_random_state.py
    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/12_random_state.py --fix

Three scenes:

- augmentation: every rank calls ``torch.manual_seed(0)`` (to start from the same model), then
  draws its random crops from that same global generator: each rank applies exactly the same
  "random" transforms. Give augmentation its own generator seeded with ``seed + rank``.
- workers: ``DataLoader`` seeds worker k with a base seed drawn from the global generator,
  plus k. Equal global seeds make worker k of every rank produce the same random numbers.
  Pass ``generator=torch.Generator().manual_seed(seed + rank)`` to the ``DataLoader``.
- hand-written DDP: ranks that build their model from different seeds (or none) start from
  different weights; averaging gradients keeps them different forever. DDP broadcasts rank 0's
  parameters and buffers when it wraps the model; by hand, broadcast them yourself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset


def augmentation_draws(rank: int, fix: bool, seed: int = 0, samples: int = 4) -> list[float]:
    """The random crop offsets a rank draws for its first samples."""
    torch.manual_seed(seed)  # the same on every rank: the model must start identical
    generator = torch.Generator().manual_seed(seed + rank) if fix else None  # None: global
    return torch.rand(samples, generator=generator).tolist()


class RandomOffsets(Dataset):
    """Each item is a random crop offset, drawn in whichever process loads it."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.rand(1).item()  # the loading process's global generator


def worker_draws(rank: int, fix: bool, seed: int = 0, workers: int = 2) -> list[float]:
    """The offsets a rank's DataLoader workers produce, in loading order."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed + rank) if fix else None
    loader = DataLoader(RandomOffsets(), batch_size=2, num_workers=workers,
                        generator=generator)  # the workers' base seed comes from it
    return [value for batch in loader for value in batch.tolist()]


def hand_ddp_weights(fix: bool, steps: int = 3) -> list[float]:
    """Train with hand-averaged gradients from a model initialised differently on each rank."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)  # e.g. seeded per rank for augmentation, before the model
    model = nn.Linear(4, 1)
    if fix:
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)  # everyone starts from rank 0's weights
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 4, generator=data)).pow(2).mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
        optimizer.step()
    return model.weight[0].tolist()


def demo(fix: bool) -> dict:
    """On this rank: the three scenes' numbers."""
    rank = dist.get_rank()
    # A daemonic process (a test's rank worker) may not start DataLoader workers.
    in_daemon = multiprocessing.current_process().daemon
    return {"rank": rank, "augmentation": augmentation_draws(rank, fix),
            "workers": None if in_daemon else worker_draws(rank, fix),
            "weights": hand_ddp_weights(fix)}


def summarize(facts: list[dict], fix: bool) -> tuple[bool, str]:
    """(symptom seen?, one-line verdict) from every rank's facts."""
    if len(facts) == 1:
        return False, "NOT SHOWN: one rank has nobody to repeat or differ from; use torchrun"
    broken = []
    if all(f["augmentation"] == facts[0]["augmentation"] for f in facts):
        broken.append("every rank drew the same augmentation")
    if facts[0]["workers"] is not None and all(f["workers"] == facts[0]["workers"]
                                               for f in facts):
        broken.append("worker k of every rank drew the same numbers")
    if any(f["weights"] != facts[0]["weights"] for f in facts):
        broken.append("the hand-written DDP models differ across ranks")
    if broken:
        return True, f"SYMPTOM: {'; '.join(broken)} (rerun with --fix)"
    return False, "FIXED: augmentation differs per rank and worker; the models agree"


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
    parser.add_argument("--fix", action="store_true", help="seed per rank; broadcast weights")
    parser.add_argument("--result", type=Path, help="rank 0 writes the facts here as JSON")
    args = parser.parse_args(argv)
    rank, world_size = setup()
    facts = [None] * world_size
    dist.all_gather_object(facts, demo(args.fix))
    symptom, verdict = summarize(facts, args.fix)
    if rank == 0:  # progress from rank 0 only
        for scene in ("augmentation", "workers", "weights"):
            for f in facts:
                if f[scene] is not None:
                    print(f"{scene:<13} rank {f['rank']}: {[round(v, 4) for v in f[scene]]}")
        print(f"verdict: {verdict}")
        if args.result:
            args.result.write_text(json.dumps({"symptom": symptom, "verdict": verdict,
                                               "ranks": facts}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
