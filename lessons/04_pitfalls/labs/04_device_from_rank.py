"""Pitfall 4 · the global rank used as the GPU index, or no ``set_device`` (GPU 0 gets it all).

Run it: the symptom, then the fix.

    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/04_device_from_rank.py
    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/04_device_from_rank.py --fix

RANK numbers the processes of the whole job; LOCAL_RANK numbers them on this machine, and
only LOCAL_RANK is a GPU index. On one machine the two coincide, so ``cuda:RANK`` seems to
work until the second machine asks for cuda:2 and cuda:3 on a board with two GPUs. And
without ``torch.cuda.set_device(local_rank)``, every bare ``"cuda"`` (``.cuda()``,
``.to("cuda")``, a tensor a dataset creates in ``__init__``) means cuda:0 in every process.

Without GPUs the lab shows the index each rule picks on an emulated job of 2 machines x 2
GPUs; with GPUs it also shows where each rank's tensors really land and, in a job of several
nodes (lesson 09 starts two on one machine), the error of a process that asks for cuda:RANK.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

# What torchrun sets on 2 machines with 2 processes each (--nnodes=2 --nproc-per-node=2).
TWO_MACHINES = [{"RANK": str(node * 2 + local), "LOCAL_RANK": str(local),
                 "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"}
                for node in range(2) for local in range(2)]


def gpu_index(env: dict, fix: bool) -> int:
    """The GPU a process picks: the global rank (the mistake) or the local rank (the fix)."""
    return int(env["LOCAL_RANK"] if fix else env["RANK"])


def demo(fix: bool) -> dict:
    """On this rank: the emulated layout's choices, and where a bare "cuda" tensor lands."""
    facts = {"rank": dist.get_rank(), "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
             "emulated": [gpu_index(env, fix) for env in TWO_MACHINES]}
    if torch.cuda.is_available():
        if fix and facts["local_rank"] >= torch.cuda.device_count():
            facts["gpus_here"] = torch.cuda.device_count()  # more processes than GPUs
            return facts
        if fix:
            torch.cuda.set_device(facts["local_rank"])  # before anything touches CUDA
        else:  # the mistake, for real: the global rank as the GPU index
            try:
                torch.zeros(1, device=torch.device("cuda", facts["rank"]))
            except RuntimeError as error:  # on a machine with fewer GPUs than that rank
                facts["rank_as_gpu_error"] = str(error).strip().splitlines()[0]
        # What the blog-style code does: a bare "cuda" (here, a dataset built in __init__).
        facts["bare_cuda_tensor"] = str(torch.zeros(1).to("cuda").device)
    return facts


def summarize(facts: list[dict], fix: bool) -> tuple[bool, str]:
    """(symptom seen?, one-line verdict) from every rank's facts."""
    emulated = facts[0]["emulated"]
    bad = any(index >= 2 for index in emulated)  # each machine has cuda:0 and cuda:1 only
    landed = sorted({f["bare_cuda_tensor"] for f in facts if "bare_cuda_tensor" in f})
    crowded = [f for f in facts if "gpus_here" in f]
    if crowded:
        f = crowded[0]
        return True, (f"SYMPTOM: rank {f['rank']} has LOCAL_RANK {f['local_rank']}, but its "
                      f"machine has {f['gpus_here']} GPU(s): start one process per GPU "
                      f"(--nproc-per-node=gpu)")
    failed = [f for f in facts if "rank_as_gpu_error" in f]
    if failed:  # a GPU index past this machine's: another node's rank, or too many processes
        f = failed[0]
        return True, (f"SYMPTOM: rank {f['rank']} (local rank {f['local_rank']}) asked for "
                      f"cuda:{f['rank']}: {f['rank_as_gpu_error']} (rerun with --fix)")
    if bad:
        where = f"; this machine's ranks put their tensors on {landed}" if landed else ""
        return True, (f"SYMPTOM: on machine 1 the processes ask for cuda:{emulated[2]} and "
                      f"cuda:{emulated[3]}, but it has cuda:0 and cuda:1{where} (rerun with --fix)")
    astray = [f for f in facts if f.get("bare_cuda_tensor", f"cuda:{f.get('local_rank')}")
              != f"cuda:{f.get('local_rank')}"]
    if astray:
        return True, (f"SYMPTOM: rank {astray[0]['rank']}'s tensors landed on "
                      f"{astray[0]['bare_cuda_tensor']}, not its cuda:LOCAL_RANK")
    where = f"; this machine's ranks use {landed}" if landed else ""
    return False, f"FIXED: every process picks cuda:LOCAL_RANK {emulated}{where}"


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
    parser.add_argument("--fix", action="store_true", help="use LOCAL_RANK and set_device")
    parser.add_argument("--result", type=Path, help="rank 0 writes the facts here as JSON")
    args = parser.parse_args(argv)
    rank, world_size = setup()
    facts = [None] * world_size
    dist.all_gather_object(facts, demo(args.fix))
    symptom, verdict = summarize(facts, args.fix)
    if rank == 0:  # progress from rank 0 only
        print("emulated job, 2 machines x 2 GPUs:")
        for env, index in zip(TWO_MACHINES, facts[0]["emulated"], strict=True):
            print(f"  RANK {env['RANK']}  LOCAL_RANK {env['LOCAL_RANK']}  ->  cuda:{index}")
        for f in facts:
            none = "n/a (no GPU of its own)" if "gpus_here" in f else "n/a (no GPU)"
            print(f"this job: rank {f['rank']} (local rank {f['local_rank']}): "
                  f"bare 'cuda' tensor on {f.get('bare_cuda_tensor', none)}"
                  + (f"; cuda:{f['rank']} failed: {f['rank_as_gpu_error']}"
                     if "rank_as_gpu_error" in f else ""))
        print(f"verdict: {verdict}")
        if args.result:
            args.result.write_text(json.dumps({"symptom": symptom, "verdict": verdict,
                                               "ranks": facts}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
