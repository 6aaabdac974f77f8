"""Lesson 04, task4_7: ``broadcast_initial_state(model, src=0)`` on pooled ranks: every
parameter and buffer (BatchNorm's statistics, its batch counter) becomes rank src's, in the
model's own tensors.

    pytest lessons/04_pitfalls -m task4_7
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.compare import assert_close
from harness.exercises import load_exercise, raise_if_untouched
from harness.ranks import RankError, run_on_ranks
from lesson04.common import GRADE_TIMEOUT, LESSON

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task4_7": {
        "every rank's model an exact copy of rank src's": [
            "test_broadcast_initial_state_copies_parameters_and_buffers",
            "test_broadcast_initial_state_writes_into_the_models_own_tensors"],
        "every parameter": ["test_broadcast_initial_state_copies_parameters_and_buffers",
                            "test_broadcast_initial_state_writes_into_the_models_own_tensors"],
        "every buffer (BatchNorm's running statistics, its batch counter)": [
            "test_broadcast_initial_state_copies_parameters_and_buffers",
            "test_broadcast_initial_state_writes_into_the_models_own_tensors"],
        "in place": ["test_broadcast_initial_state_writes_into_the_models_own_tensors"],
    },
}


def broadcasting_on_rank(ctx, src: int) -> dict:
    torch.manual_seed(10 + ctx.rank)  # a different model on every rank
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    with torch.no_grad():
        model[1].running_mean.normal_()
        model[1].num_batches_tracked += ctx.rank + 1
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if src is None:  # the default: rank 0's state
        load_exercise(LESSON).broadcast_initial_state(model)
    else:
        load_exercise(LESSON).broadcast_initial_state(model, src=src)
    return {"before": before, "after": model.state_dict(),
            "buffers": [name for name, _ in model.named_buffers()]}


@pytest.mark.task4_7
@pytest.mark.parametrize("src", [0, 1, None], ids=["src=0", "src=1", "default"])
def test_broadcast_initial_state_copies_parameters_and_buffers(ex, src):
    """On 2 gloo ranks whose models start from different seeds, every parameter and buffer
    (BatchNorm's running statistics and batch counter) equals rank src's after the call, for src=0,
    src=1 and the default, rank 0."""
    raise_if_untouched(ex.broadcast_initial_state)  # not attempted: no ranks
    try:
        results = run_on_ranks(broadcasting_on_rank, src, pg_timeout=GRADE_TIMEOUT, timeout=40)
    except RankError as error:
        if "Timed out" not in str(error):
            raise
        raise AssertionError(
            f"the ranks hung in broadcast_initial_state(model, src={src}) (process-group "
            f"timeout {GRADE_TIMEOUT} s): every rank must call dist.broadcast with the same src, "
            f"the rank whose values everyone copies (src=src, not dist.get_rank()), and the "
            f"same tensors in the same order.\n{error}") from None
    source = results[src or 0]["before"]
    called = "without src (the default is rank 0)" if src is None else f"from rank {src}"
    for rank, r in enumerate(results):
        for name, tensor in source.items():
            kind = "buffer" if name in r["buffers"] else "parameter"
            assert_close(r["after"][name], tensor, f"{kind} {name} after broadcasting {called}",
                         rank=rank)


def broadcasting_in_place_on_rank(ctx, src: int) -> dict:
    torch.manual_seed(10 + ctx.rank)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    held = model.state_dict(keep_vars=True)  # the very tensors (an optimizer holds the same)
    before = {k: v.detach().clone() for k, v in held.items()}
    load_exercise(LESSON).broadcast_initial_state(model, src=src)
    now = model.state_dict(keep_vars=True)
    return {"before": before, "held_after": {k: v.detach().clone() for k, v in held.items()},
            "replaced": [k for k in held if now[k] is not held[k]],
            "buffers": [name for name, _ in model.named_buffers()]}


@pytest.mark.task4_7
def test_broadcast_initial_state_writes_into_the_models_own_tensors(ex):
    """On 2 gloo ranks with src=1, the tensors the model held before the call (as an optimizer would
    hold them) hold rank 1's values after it: the copy is made in place."""
    raise_if_untouched(ex.broadcast_initial_state)  # not attempted: no ranks
    results = run_on_ranks(broadcasting_in_place_on_rank, 1, pg_timeout=GRADE_TIMEOUT,
                           timeout=40)
    source = results[1]["before"]
    for rank, r in enumerate(results):
        for name, tensor in source.items():
            kind = "buffer" if name in r["buffers"] else "parameter"
            if not torch.equal(r["held_after"][name], tensor):
                replaced = (f" (the model now holds another tensor as {name})"
                            if name in r["replaced"] else "")
                raise AssertionError(
                    f"rank {rank}: the tensor that was the model's {kind} {name} before the "
                    f"call does not hold rank 1's values after it{replaced}: broadcast into "
                    f"the model's own tensors, in place (dist.broadcast(tensor, src) "
                    f"overwrites tensor); an optimizer built before the call holds them")
