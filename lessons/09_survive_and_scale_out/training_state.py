"""The training state, saved, found and resumed, and the stop that saves it: what lesson 09's
three training scripts share.

train_checkpoint.py uses save, resume_point and load; train_resilient.py adds ResumableSampler
(an epoch that starts where it stopped) and say_who (each rank's line: which attempt this is);
train_preemptible.py adds Preemption (a signal stops every rank at the next step boundary) and
cpu_group (where the ranks agree on it). ResumableSampler, resume_point and Preemption are
answers to task9_1, task9_3 and task9_5: tests/test_wrong_answers.py runs those graders on them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
from gpt import run  # noqa: E402


def save(path: Path, parts: dict, position: dict) -> None:
    """Rank 0 writes <path>.partial/train.pt, with every rank's generators, then renames it."""
    generators = [None] * dist.get_world_size()  # each rank's: they draw different masks
    dist.all_gather_object(generators, run.rng_state())  # bytes: map_location cannot move them
    if dist.get_rank() == 0:
        partial = path.with_name(path.name + ".partial")
        partial.mkdir(parents=True, exist_ok=True)  # an earlier crash's is overwritten
        torch.save({**{name: part.state_dict() for name, part in parts.items()},
                    "position": position, "generators": generators}, partial / "train.pt")
        run.replace_directory(partial, path)  # fsynced, then renamed: whole or not at all
    dist.barrier()  # no rank goes on before it is there


def resume_point(folder: Path) -> Path | None:
    """The newest step-<N>/ whose train.pt is whole (a zip archive's index is written last)."""
    found = [path for path in folder.glob("step-*") if path.name[5:].isdigit()
             and zipfile.is_zipfile(path / "train.pt")]
    return max(found, key=lambda path: int(path.name[5:]), default=None)


def load(path: Path, parts: dict, device) -> dict:
    state = torch.load(path / "train.pt", map_location=device, weights_only=True)
    for name, part in parts.items():
        part.load_state_dict(state[name])
    run.set_rng_state(state["generators"][dist.get_rank()])  # this rank's own, CUDA's too
    return state["position"]


class ResumableSampler(DistributedSampler):
    """DistributedSampler whose epoch can start at this rank's ``start``-th sample."""

    start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        if not 0 <= start <= self.num_samples:
            raise ValueError(f"start {start} is outside this rank's epoch of "
                             f"{self.num_samples} samples")
        super().set_epoch(epoch)
        self.start = start

    def __iter__(self):  # the epoch's order depends on (seed, epoch, rank, world) alone
        return iter(list(super().__iter__())[self.start:])

    def __len__(self) -> int:
        return self.num_samples - self.start


class Preemption:
    """``with Preemption() as stop``: the signals only set a flag; at each step boundary
    ``stop.requested()``, one all-reduce, tells every rank whether any rank caught one."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)):
        self.signals, self.caught, self.signal = tuple(signals), 0, 0

    def __enter__(self) -> Preemption:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("enter Preemption in the main thread: Python runs signal "
                               "handlers there only")
        self._previous = {sig: signal.signal(sig, self._catch) for sig in self.signals}
        return self

    def _catch(self, signum, frame) -> None:
        # Nothing more: it runs between two bytecodes, maybe inside a collective or a save.
        self.caught = self.caught or signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():  # None: one installed outside Python
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def requested(self, group=None, device="cpu") -> bool:
        flag = torch.tensor([self.caught], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)  # any rank's, on every rank
        if not self.signal:  # the first agreement stands
            self.signal = int(flag.item())
        return self.signal != 0

    @property
    def exit_code(self) -> int:  # what a shell reports for a process the signal ended
        return 128 + self.signal if self.signal else 0


def say_who(device: torch.device) -> None:
    """Print, on every rank, who it is, which attempt this is and where it runs."""
    where = " ".join(f"{name}={os.environ.get(name, '-')}" for name in (
        "RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"))
    # One write, so that lines of processes that share a terminal (two torchruns on one
    # machine) stay whole.
    print(f"{where} device={device}\n", end="", flush=True)


def cpu_group():
    """A gloo group for numbers the CPU reads (a stop flag): asking never waits for the GPU to
    finish the step, as nccl would (a GPU tensor, then .item()). None where the default group
    is gloo already."""
    if dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo", timeout=run.TIMEOUT)  # not gloo's 30 min default
