"""Pitfall 6 · uneven inputs: the rank with more batches waits forever.

Run it: the symptom, then the fix.

    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/06_uneven_inputs.py
    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/06_uneven_inputs.py --fix

Every DDP backward all-reduces the gradients, so every rank must take the same number of
steps. When the data does not split evenly (files of different lengths, an IterableDataset,
a hand-made split), rank r here has 3 + r batches: rank 0 finishes and waits at the final
barrier while rank 1 waits in its 4th backward for a partner. Both wait until the timeout.

The fix here is ``torch.distributed.algorithms.Join``: a rank that runs out of data "joins"
and, until every rank has, answers the others' all-reduces with zeros; at the end the ranks
agree on the final parameters again. The other fix is to give every rank the same number of
batches (``DistributedSampler`` pads; or all-reduce the minimum and stop there).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP


def demo(fix: bool) -> dict:
    """Train on this rank's 3 + rank batches, then wait for everyone at a final barrier."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator))
               for _ in range(3 + rank)]
    steps = 0
    with Join([model]) if fix else contextlib.nullcontext():
        for inputs, targets in batches:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()
            steps += 1
    dist.barrier()  # "wait for everyone before saving": where rank 0 waits
    weight = model.module.weight.detach().clone()
    del model, optimizer
    gc.collect()  # free now what only reference cycles hold, before the group goes
    return {"rank": rank, "batches": len(batches), "steps": steps, "weight": weight.tolist()}


def summarize(facts: list[dict], fix: bool) -> tuple[bool, str]:
    """(symptom seen?, one-line verdict) from the ranks' facts. After a hang the group is
    broken and no rank can gather the others' facts, so each rank passes its own."""
    for f in facts:
        if f["error"]:
            return True, (f"SYMPTOM: rank {f['rank']} waited {f['waited']:.1f} s for a "
                          f"partner, then: {f['error']} (rerun with --fix)")
    if facts[0]["world_size"] == 1:
        return False, "NOT SHOWN: one rank cannot be uneven; start 2 ranks with torchrun"
    return False, "FIXED: every rank trained on all its batches; nobody hung"


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
    parser.add_argument("--fix", action="store_true", help="train inside Join([model])")
    parser.add_argument("--timeout", type=float, default=5.0, help="process-group timeout, s")
    parser.add_argument("--result", type=Path, help="rank 0 writes the outcome here as JSON")
    args = parser.parse_args(argv)
    rank, world_size = setup(timeout=args.timeout)
    facts = {"rank": rank, "world_size": world_size, "error": None}
    began = time.monotonic()
    try:
        facts.update(demo(args.fix))
        print(f"rank {rank}: {facts['steps']} steps on its {facts['batches']} batches, "
              f"final weight {[round(w, 4) for w in facts['weight'][0]]}", flush=True)
    except RuntimeError as error:  # this rank waited --timeout seconds, then torch gave up
        facts["error"] = str(error).splitlines()[0].split("] ", 1)[-1]  # without gloo's line
    facts["waited"] = time.monotonic() - began
    gc.collect()
    symptom, verdict = summarize([facts], args.fix)  # after a hang, nobody can gather the rest
    if rank == 0 or symptom:  # normally rank 0 speaks; a rank that failed speaks for itself
        print(f"verdict: {verdict}", flush=True)
    if rank == 0 and args.result:
        args.result.write_text(json.dumps({"symptom": symptom, "verdict": verdict,
                                           "ranks": [facts]}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
