"""Pitfall 9 · checkpoints: who writes, when others read, what the file holds, and crashes.

Run it: the symptoms, then the fixes.

    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/09_checkpoints.py
    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/labs/09_checkpoints.py --fix

Five mistakes, one scene each:

- writers: every rank saves the same file: W writers race on one path (on a shared file
  system the result can be a mix). Only rank 0 writes.
- early read: rank 1 loads while rank 0 is still writing: the file is missing, partial, or the
  previous one. A barrier that every rank calls, after the save, makes them wait.
- prefix: ``ddp_model.state_dict()`` names every tensor ``module.<name>``, so a plain model
  refuses it. Save ``ddp_model.module.state_dict()`` (or strip the prefix when loading).
- map_location: ``torch.load`` puts tensors back on the device they were saved from: cuda:0,
  in every process (or an error on a machine without CUDA). Pass ``map_location``.
- crash: ``torch.save(state, path)`` truncates ``path`` first; a crash mid-write destroys the
  previous checkpoint too. Write a temporary file in the same folder, then ``os.replace``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import io
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.serialization
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class SimulatedCrash(Exception):
    """Stands for the process dying in the middle of writing a file."""


@contextlib.contextmanager
def crash_midway():
    """Make ``torch.save`` write half of its bytes to the destination, then "crash"."""
    real_save = torch.save

    def half_save(obj, destination, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        with contextlib.ExitStack() as stack:
            file = destination
            if isinstance(destination, (str, os.PathLike)):
                file = stack.enter_context(open(destination, "wb"))  # truncates, as torch.save
            file.write(data[: len(data) // 2])
        raise SimulatedCrash("killed while writing")

    torch.save = half_save
    try:
        yield
    finally:
        torch.save = real_save


@contextlib.contextmanager
def written_on_cuda0():
    """Make ``torch.save`` record every tensor as living on cuda:0, as a GPU job's file does,
    so the map_location scene shows the same thing with or without a GPU."""
    def tag(storage):
        return "cuda:0" if storage.device.type == "cpu" else None

    torch.serialization.register_package(0, tag, lambda storage, location: None)
    try:
        yield
    finally:  # register_package has no public inverse (torch 2.11 to 2.13): undo it by hand
        registry = torch.serialization._package_registry
        registry[:] = [entry for entry in registry if entry[1] is not tag]


def save_atomically(state: dict, path: Path) -> None:
    """Write to a temporary name in the same folder, then rename: ``path`` is always whole."""
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, path)  # atomic on one file system: readers see old or new, never half


def outcome(action) -> str:
    """'ok' or the error an action raised, in one line."""
    try:
        action()
        return "ok"
    except Exception as error:  # noqa: BLE001 - the error is what the scene shows
        return f"{type(error).__name__}: {' '.join(str(error).split())[:160]}"


def demo(fix: bool, folder: str) -> dict:
    """Every scene on this rank; returns what happened in each."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    state = model.module.state_dict() if fix else model.state_dict()  # prefix scene, part 1
    facts = {"rank": rank}

    # writers: how many ranks wrote the file
    path = Path(folder) / "writers.pt"
    wrote = torch.tensor(1 if rank == 0 or not fix else 0)
    if wrote:
        torch.save(state, path)
    dist.all_reduce(wrote)
    facts["writers"] = int(wrote)
    dist.barrier()

    # early read: rank 0 writes a large (slow) checkpoint; the others load it right away
    path = Path(folder) / "early.pt"
    if rank == 0:
        time.sleep(0.5)  # a big file takes a while to write
        torch.save(state, path)
    if fix:
        dist.barrier()  # outside the if: every rank waits until rank 0 has written
    facts["early_read"] = outcome(lambda: torch.load(path, weights_only=True))
    dist.barrier()

    # prefix: load the saved state into a plain, unwrapped model
    facts["prefix"] = outcome(lambda: nn.Linear(4, 1).load_state_dict(state))

    # map_location: load a checkpoint written by a process on cuda:0
    buffer = io.BytesIO()
    with written_on_cuda0():
        torch.save(state, buffer)
    buffer.seek(0)
    here = torch.device("cpu")
    loaded = {}
    facts["map_location"] = outcome(lambda: loaded.update(
        torch.load(buffer, map_location=here, weights_only=True) if fix
        else torch.load(buffer, weights_only=True)))
    if loaded:
        facts["map_location"] += f" (tensors on {next(iter(loaded.values())).device})"

    # crash: a save that dies halfway, on top of a good checkpoint
    path = Path(folder) / f"crash-{rank}.pt"
    torch.save(state, path)  # the previous, good checkpoint
    with crash_midway():
        facts["crash_save"] = outcome(
            lambda: save_atomically(state, path) if fix else torch.save(state, path))
    facts["crash"] = outcome(lambda: torch.load(path, weights_only=True))  # the previous one?
    del model
    gc.collect()  # free now what only reference cycles hold, before the group goes
    return facts


SCENES = ("writers", "early_read", "prefix", "map_location", "crash")


def summarize(facts: list[dict], fix: bool) -> tuple[bool, str]:
    """(symptom seen?, one-line verdict) from every rank's facts."""
    broken = []
    if facts[0]["writers"] > 1:
        broken.append("writers")
    broken += [scene for scene in SCENES[1:]
               if any(not f[scene].startswith("ok") or "cuda" in f[scene] for f in facts)]
    if broken:
        return True, f"SYMPTOM: broken scenes: {', '.join(broken)} (rerun with --fix)"
    return False, "FIXED: one writer, nobody reads early, plain keys, CPU tensors, crash-safe"


def shared_folder() -> str:
    """A temporary folder that rank 0 creates and every rank knows."""
    name = [tempfile.mkdtemp(prefix="lab09-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return name[0]


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
    parser.add_argument("--fix", action="store_true", help="save and load the safe way")
    parser.add_argument("--result", type=Path, help="rank 0 writes the facts here as JSON")
    args = parser.parse_args(argv)
    rank, world_size = setup()
    folder = shared_folder()
    facts = [None] * world_size
    dist.all_gather_object(facts, demo(args.fix, folder))
    symptom, verdict = summarize(facts, args.fix)
    if rank == 0:  # progress from rank 0 only
        print(f"writers: {facts[0]['writers']} of {world_size} ranks wrote the same file")
        for scene in SCENES[1:]:
            for f in facts:
                print(f"{scene:<13} rank {f['rank']}: {f[scene]}")
        print(f"verdict: {verdict}")
        shutil.rmtree(folder, ignore_errors=True)
        if args.result:
            args.result.write_text(json.dumps({"symptom": symptom, "verdict": verdict,
                                               "ranks": facts}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
