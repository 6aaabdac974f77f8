"""The plumbing of a training run that no lesson teaches, shared by every lesson's script.

A lesson's script keeps what its lesson changes; what every run needs the same way lives here,
once, so that the diff between two steps of the chain is the lesson and nothing else.

- Files that must survive a crash and a power loss: :func:`sync_to_disk` and
  :func:`replace_directory` (lesson 09 explains why each step is there).
- Generator states a checkpoint can carry to any device: :func:`rng_state` and
  :func:`set_rng_state`.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import torch


def sync_to_disk(path: str | os.PathLike) -> None:
    """``os.fsync`` a file or a directory: its bytes (or its entries: the names in it) reach
    the disk before this returns, not only the operating system's cache. Where directories
    cannot be opened (Windows), a directory is left to the file system."""
    if Path(path).is_dir() and os.name == "nt":  # Windows opens no directory for fsync
        return
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def replace_directory(partial: str | os.PathLike, path: str | os.PathLike) -> None:
    """Make the finished directory ``partial`` appear as ``path``, whole or not at all, even
    across a power loss: fsync every file in it and the directory itself, rename it, then fsync
    the parent so that the rename is on the disk too. A ``path`` that exists already (the same
    step saved before a restart, perhaps broken) is renamed aside first and removed after: a
    rename cannot replace a directory that is not empty."""
    partial, path = Path(partial), Path(path)
    for file in partial.iterdir():
        if file.is_file():
            sync_to_disk(file)
    sync_to_disk(partial)
    if path.exists():
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        os.replace(partial, path)
        shutil.rmtree(old)
    else:
        os.replace(partial, path)
    sync_to_disk(path.parent)


def rng_state() -> dict:
    """This process's generator states: torch's CPU one, Python's, and CUDA's once in use.

    torch's states are kept as ``bytes``, not tensors: ``torch.load(..., map_location=device)``
    moves every tensor of a file to ``device``, and ``torch.set_rng_state`` (CUDA's too) takes
    a CPU ``ByteTensor`` only, so tensor states loaded onto a GPU could not be restored.
    """
    state = {"torch": bytes(torch.get_rng_state().tolist()), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [bytes(s.tolist()) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    def byte_tensor(data: bytes) -> torch.Tensor:  # a CPU ByteTensor, as set_rng_state needs
        return torch.tensor(list(data), dtype=torch.uint8)

    torch.set_rng_state(byte_tensor(state["torch"]))
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all([byte_tensor(s) for s in state["cuda"]])
