"""Pitfall 3 · evaluating with ``DistributedSampler``: padded duplicates skew the metric.

Run it: the symptom, then the fix.

    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/03_padded_eval.py
    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/03_padded_eval.py --fix

To give every rank the same number of samples, ``DistributedSampler`` pads its order with
samples from the start: 11 samples on 2 ranks become 12, one of them counted twice. Averaging
each rank's accuracy adds a second error: ranks that saw fewer samples weigh as much as the
others. The exact metric counts every sample once: each rank sums its correct answers and its
sample count over a shard without padding, one ``all_reduce`` adds them up, then divide.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

# Which of the 11 validation samples the classifier gets right. The first one, which the
# sampler repeats as padding, is wrong: padding counts a mistake twice.
RIGHT = [0, 1, 1, 1, 1, 0, 1, 0, 1, 1, 1]


def validation_set() -> tuple[nn.Module, TensorDataset]:
    """A fixed 2-class classifier (it predicts argmax(x)) and samples it gets RIGHT or wrong."""
    model = nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.copy_(torch.eye(2))
        model.bias.zero_()
    predicted = torch.tensor([i % 2 for i in range(len(RIGHT))])
    inputs = nn.functional.one_hot(predicted, 2).float()
    targets = torch.where(torch.tensor(RIGHT).bool(), predicted, 1 - predicted)
    return model, TensorDataset(inputs, targets)


def correct_and_count(model: nn.Module, loader) -> torch.Tensor:
    totals = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for inputs, targets in loader:
            totals[0] += (model(inputs).argmax(dim=1) == targets).sum()
            totals[1] += len(targets)
    return totals


def demo(fix: bool) -> dict:
    """On this rank: the samples it evaluated and the accuracy the variant reports."""
    model, dataset = validation_set()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    truth = correct_and_count(model, DataLoader(dataset, batch_size=4))  # one process, all data
    facts = {"rank": rank, "truth": (truth[0] / truth[1]).item()}
    if fix:
        shard = Subset(dataset, range(rank, len(dataset), world_size))  # no padding: uneven is ok
        totals = correct_and_count(model, DataLoader(shard, batch_size=4))
        dist.all_reduce(totals)  # sums: every sample counted exactly once
        facts.update(shard=list(shard.indices), reported=(totals[0] / totals[1]).item())
    else:
        sampler = DistributedSampler(dataset, shuffle=False)  # pads to a multiple of world_size
        totals = correct_and_count(model, DataLoader(dataset, batch_size=4, sampler=sampler))
        dist.all_reduce(totals)
        # The other mistake, even without padding: averaging accuracies of unequal shards.
        shard = Subset(dataset, range(rank, len(dataset), world_size))
        mine = correct_and_count(model, DataLoader(shard, batch_size=4))
        accuracies = [None] * world_size
        dist.all_gather_object(accuracies, (mine[0] / mine[1]).item())
        facts.update(shard=list(sampler), reported=(totals[0] / totals[1]).item(),
                     mean_of_ranks=sum(accuracies) / world_size)
    return facts


def summarize(facts: list[dict], fix: bool) -> tuple[bool, str]:
    """(symptom seen?, one-line verdict) from every rank's facts."""
    evaluated = sum(len(f["shard"]) for f in facts)
    truth, reported = facts[0]["truth"], facts[0]["reported"]
    if abs(reported - truth) > 1e-9:
        return True, (f"SYMPTOM: accuracy {reported:.4f} over {evaluated} evaluations of "
                      f"{len(RIGHT)} samples; the true accuracy is {truth:.4f} (rerun with --fix)")
    if not fix and evaluated == len(RIGHT):
        return False, "NOT SHOWN: no padding with this many ranks; try --nproc-per-node=2 or 3"
    return False, f"FIXED: accuracy {reported:.4f}, every sample counted once, as one process"


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
    parser.add_argument("--fix", action="store_true", help="count every sample exactly once")
    parser.add_argument("--result", type=Path, help="rank 0 writes the facts here as JSON")
    args = parser.parse_args(argv)
    rank, world_size = setup()
    facts = [None] * world_size
    dist.all_gather_object(facts, demo(args.fix))
    symptom, verdict = summarize(facts, args.fix)
    if rank == 0:  # progress from rank 0 only
        for f in facts:
            print(f"rank {f['rank']} evaluated samples {f['shard']}")
        if not args.fix:
            print(f"mean of the ranks' accuracies on unpadded shards: "
                  f"{facts[0]['mean_of_ranks']:.4f}")
        print(f"verdict: {verdict}")
        if args.result:
            args.result.write_text(json.dumps({"symptom": symptom, "verdict": verdict,
                                               "ranks": facts}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
