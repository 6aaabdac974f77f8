"""Lesson 04, task4_3: ``save_on_rank0(model, path)`` on pooled ranks, with a slow torch.save: only
rank 0 writes, the unwrapped state dict, to a temporary file replaced onto the path (the
previous checkpoint stays readable meanwhile), and every rank waits at the barrier.

    pytest lessons/04_pitfalls -m task4_3
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from harness.compare import assert_parameters_close
from harness.exercises import load_exercise, raise_if_untouched
from harness.ranks import RankError, run_on_ranks
from lesson04.common import GRADE_TIMEOUT, LESSON

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task4_3": {
        "only rank 0 writes": ["test_save_on_rank0_writes_once_atomically_and_everyone_waits"],
        "it writes model.module.state_dict() (without DDP's module. prefix)":
            ["test_save_on_rank0_writes_once_atomically_and_everyone_waits"],
        "it writes to a temporary file in the same folder, then os.replaces it onto path":
            ["test_save_on_rank0_writes_once_atomically_and_everyone_waits"],
        "every rank then waits at dist.barrier(), outside the if rank == 0":
            ["test_save_on_rank0_writes_once_atomically_and_everyone_waits"],
    },
}


def saving_on_rank(ctx, folder: str, *, as_text: bool = False) -> dict:
    """Call save_on_rank0 with a slow torch.save that records what it writes, and where;
    ``as_text``: pass the path as a str (the contract takes a str or a path-like)."""
    path = Path(folder) / "model.pt"
    torch.manual_seed(0)
    if ctx.rank == 0:
        torch.save(nn.Linear(4, 2).state_dict(), path)  # the previous checkpoint
    dist.barrier()
    torch.manual_seed(1)
    model = DDP(nn.Linear(4, 2))  # the new weights (rank 0's, broadcast by DDP)
    calls = []
    real_save = torch.save

    def slow_save(obj, destination, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        target = destination if isinstance(destination, (str, os.PathLike)) else getattr(
            destination, "name", None)
        calls.append({"target": str(target), "keys": sorted(obj)})
        with contextlib.ExitStack() as stack:
            file = destination
            if isinstance(destination, (str, os.PathLike)):
                file = stack.enter_context(open(destination, "wb"))
            file.write(data[: len(data) // 2])  # a big file takes a while: half now ...
            file.flush()
            time.sleep(0.3)
            calls[-1]["previous_readable_mid_write"] = readable(path)
            file.write(data[len(data) // 2:])  # ... and the rest later

    torch.save = slow_save
    try:
        load_exercise(LESSON).save_on_rank0(model, str(path) if as_text else path)
    finally:
        torch.save = real_save
    read = readable(path)  # what this rank finds right after the call returns
    new = {k: v.clone() for k, v in model.module.state_dict().items()}
    dist.barrier()
    files = sorted(os.listdir(folder))
    del model
    return {"calls": calls, "read": read, "new": new, "files": files}


def readable(path: Path):
    try:
        return torch.load(path, weights_only=True)
    except Exception as error:  # noqa: BLE001 - the error is the finding
        return f"{type(error).__name__}: {str(error)[:120]}"


@pytest.mark.task4_3
@pytest.mark.parametrize("as_text", [False, True], ids=["Path", "str"])
def test_save_on_rank0_writes_once_atomically_and_everyone_waits(ex, tmp_path, as_text):
    """On 2 gloo ranks with a slowed `torch.save`, given a `Path` or a `str`: only rank 0 saves,
    once, keys without `module.`, to a temporary file in the same folder (the previous checkpoint
    stays readable), and no rank returns before the new one is complete.

    Every rank then reads the new weights, and no file is left beside the checkpoint. A barrier
    inside the `if` shows up as torch's timeout error within the 5 s process-group timeout, not a
    hang."""
    raise_if_untouched(ex.save_on_rank0)  # not attempted: no ranks
    try:
        results = run_on_ranks(saving_on_rank, str(tmp_path), as_text=as_text,
                               pg_timeout=GRADE_TIMEOUT, timeout=40)
    except RankError as error:
        if "Timed out" not in str(error):
            why = (" given the path as a str: take Path(path) first" if as_text
                   and "AttributeError" in str(error) else " (if several ranks write the same "
                   "file, they race: only rank 0 should write)")
            raise AssertionError(f"save_on_rank0 raised on a rank{why}:\n{error}") from None
        raise AssertionError(
            f"save_on_rank0 did not return on every rank within {GRADE_TIMEOUT} s: is "
            f"dist.barrier() inside `if rank == 0`? Every rank must call it.\n{error}") from None
    path = tmp_path / "model.pt"
    writers = [rank for rank, r in enumerate(results) for _ in r["calls"]]
    assert writers == [0], f"torch.save was called on ranks {writers}: only rank 0 should write"
    call = results[0]["calls"][0]
    prefixed = [k for k in call["keys"] if k.startswith("module.")]
    assert not prefixed, f"saved keys {prefixed}: save model.module.state_dict(), not the DDP's"
    assert call["target"] != str(path) and isinstance(call["previous_readable_mid_write"], dict), (
        f"torch.save wrote straight to {path.name}: while it wrote, the previous checkpoint was "
        f"unreadable ({call['previous_readable_mid_write']}); a crash then loses both. Write to a "
        f"temporary file in the same folder, then os.replace it onto the path")
    assert Path(call["target"]).parent == path.parent, (
        f"the temporary file {call['target']} is not in {path.parent}: os.replace is only "
        f"atomic within one file system, so keep it in the checkpoint's folder")
    for rank, r in enumerate(results):
        assert isinstance(r["read"], dict), f"rank {rank} cannot read the checkpoint: {r['read']}"
        try:
            assert_parameters_close(r["read"], r["new"], rank=rank,
                                    what="checkpoint read right after save_on_rank0")
        except AssertionError as error:
            raise AssertionError(
                f"{error}\nrank {rank} read the previous checkpoint: every rank must wait at "
                f"dist.barrier() after rank 0 has written (the barrier outside the if)") from None
        assert r["files"] == ["model.pt"], f"rank {rank}: files left behind: {r['files']}"
