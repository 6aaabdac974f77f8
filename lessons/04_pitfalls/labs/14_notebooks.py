"""Pitfall 14 · notebooks: why the cell fails or hangs, and the safe way to launch from one.

Run it with plain python: the symptoms, then the fix.

    python lessons/04_pitfalls/labs/14_notebooks.py
    python lessons/04_pitfalls/labs/14_notebooks.py --fix

A notebook kernel is one long-lived process whose ``__main__`` is not a file. Two things go
wrong there:

- ``torch.multiprocessing.spawn(work, ...)`` starts fresh interpreters that must import
  ``work`` by name; a function defined in a cell lives in no file, so every child dies with
  "Can't get attribute 'work' on <module '__main__'>" (the kernel's terminal shows it, the
  notebook often shows only a generic error, or the cell sits at [*]). Code that runs at
  import, without an ``if __name__ == "__main__":`` guard, runs again in every child.
- ``dist.init_process_group(..., world_size=2)`` in the kernel waits for a second process
  that nobody starts: the cell hangs for the whole timeout (by default 30 minutes with gloo,
  10 when the backend is "nccl").

The fix: keep the training code in a script with a ``__main__`` guard (``%%writefile
train.py`` in a notebook) and start it with ``torchrun`` as a subprocess, waiting with a
timeout (``launch_from_notebook`` below). The kernel stays one process. On a timeout, send
torchrun SIGTERM, which it passes on to its workers: ``subprocess.run(..., timeout=...)`` kills
torchrun with SIGKILL and leaves the workers running, each in a session of its own.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

# What a learner types into a notebook cell: a worker function and mp.spawn.
NOTEBOOK_CELL = """
import torch.multiprocessing as mp

def work(rank):
    print(f"rank {rank} is training")

mp.spawn(work, nprocs=2)
"""

# The same work as a script, with the guard: what %%writefile train.py would hold.
TRAINING_SCRIPT = """
import torch
import torch.distributed as dist


def main():
    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks trained; all-reduce gave {total.item():g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


def start_cell() -> subprocess.Popen:
    """Start running NOTEBOOK_CELL as a kernel does: as code with no file behind ``__main__``."""
    return subprocess.Popen([sys.executable, "-c", NOTEBOOK_CELL], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def cell_outcome(cell: subprocess.Popen, timeout: float = 120) -> dict:
    """Wait for the cell; its exit code and the error its spawned children reported."""
    _, stderr = cell.communicate(timeout=timeout)
    missing = re.search(r"Can't get attribute '\w+' on <module '__main__'[^>]*>", stderr)
    error = f"AttributeError: {missing.group(0)}" if missing else stderr.strip()[-300:]
    return {"returncode": cell.returncode, "error": error}


def init_without_partners(timeout: float = 2.0) -> str:
    """``init_process_group`` for 2 ranks with only this process: what it raises, and when."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    began = time.monotonic()
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=2, timeout=datetime.timedelta(seconds=timeout))
    except Exception as error:  # noqa: BLE001 - the error is what the lab shows
        return f"after {time.monotonic() - began:.1f} s: {type(error).__name__}: {error}"
    dist.destroy_process_group()
    return "joined (unexpected)"


def launch_from_notebook(script: Path, nproc: int = 2, timeout: float = 120) -> dict:
    """The safe pattern: torchrun in a subprocess, waited for with a timeout; its output.
    On a timeout torchrun gets SIGTERM, which it passes on to its workers (it waits up to 30 s
    for them), not the SIGKILL of ``subprocess.run``'s timeout, which would leave them running."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", str(script)]
    launch = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        output, _ = launch.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        launch.terminate()  # SIGTERM: torchrun stops its workers, then exits
        try:
            output, _ = launch.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            launch.kill()
            output, _ = launch.communicate()
    return {"returncode": launch.returncode, "output": output.strip()}


def demo(fix: bool) -> dict:
    """What the notebook sees. The symptom: a cell's mp.spawn, and a lone init_process_group
    while it runs. The fix: a guarded script written to a file and launched with torchrun."""
    if fix:
        with tempfile.TemporaryDirectory() as folder:
            script = Path(folder) / "train.py"
            script.write_text(TRAINING_SCRIPT)  # a notebook: %%writefile train.py
            return {"launch": launch_from_notebook(script)}
    cell = start_cell()
    facts = {"init": init_without_partners()}  # while the cell's children start
    facts["spawn"] = cell_outcome(cell)
    return facts


def summarize(facts: dict, fix: bool) -> tuple[bool, str]:
    """(symptom seen?, one-line verdict) from the facts of this one process, the kernel."""
    if "launch" in facts:
        if facts["launch"]["returncode"] == 0:
            return False, ("FIXED: the guarded script ran on 2 ranks under torchrun, started as "
                           "a subprocess; this process stayed one process")
        return True, "NOT FIXED: torchrun failed"
    if facts["spawn"]["returncode"] != 0 and "Timed out" in facts["init"]:
        return True, ("SYMPTOM: the spawned children cannot find a function defined in a cell, "
                      "and a lone init_process_group waits for partners (rerun with --fix)")
    return False, "NOT SHOWN: the cell's spawn worked"


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
    parser.add_argument("--fix", action="store_true", help="launch a guarded script with "
                        "torchrun in a subprocess")
    parser.add_argument("--result", type=Path, help="writes the outcome here as JSON")
    args = parser.parse_args(argv)
    if "RANK" in os.environ:  # started by torchrun: this lab is about not being there
        rank, _ = setup()  # join the group, so the ranks end together and rank 0 speaks
        # init_process_group can return on one rank before the others have connected to it:
        # leaving at once would close its sockets under them. A barrier first.
        dist.barrier()
        if rank == 0:
            verdict = "NOT SHOWN: this lab plays a notebook kernel; run it with python"
            print(f"verdict: {verdict}")
            if args.result:
                args.result.write_text(json.dumps({"symptom": False, "verdict": verdict}))
        dist.destroy_process_group()
        return
    facts = demo(args.fix)
    if "launch" in facts:
        print(f"torchrun exited with {facts['launch']['returncode']}: "
              f"{facts['launch']['output']}")
    else:
        print(f"mp.spawn from a cell: exit code {facts['spawn']['returncode']}: "
              f"{facts['spawn']['error']}")
        print(f"init_process_group(world_size=2) alone: {facts['init']}")
    symptom, verdict = summarize(facts, args.fix)
    print(f"verdict: {verdict}")
    if args.result:
        args.result.write_text(json.dumps({"symptom": symptom, "verdict": verdict, **facts}))


if __name__ == "__main__":
    main()
