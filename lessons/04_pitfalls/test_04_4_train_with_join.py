"""Lesson 04, task4_4: ``train_with_join`` on pooled ranks with uneven batch counts: no hang
(Join), a step for every batch, and the weights of a Join reference.

    pytest lessons/04_pitfalls -m task4_4
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from harness.compare import assert_parameters_close
from harness.exercises import load_exercise, raise_if_untouched
from harness.ranks import RankError, run_on_ranks
from lesson04.common import GRADE_TIMEOUT, LESSON, mse_of_output_and_target

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task4_4": {
        "one step per (inputs, targets): zero the gradients, backward, optimizer.step()":
            ["test_train_with_join_trains_every_batch_without_hanging"],
        "wrap the loop in Join([model]): ranks with fewer batches do not hang":
            ["test_train_with_join_trains_every_batch_without_hanging"],
        "train on every batch: none is dropped":
            ["test_train_with_join_trains_every_batch_without_hanging"],
        "return the number of steps this rank took":
            ["test_train_with_join_trains_every_batch_without_hanging"],
    },
}


def joining_on_rank(ctx) -> dict:
    generator = torch.Generator().manual_seed(ctx.rank)
    batches = [(torch.randn(4, 3, generator=generator), torch.randn(4, 1, generator=generator))
               for _ in range(2 + 2 * ctx.rank)]
    torch.manual_seed(0)
    model = DDP(nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = load_exercise(LESSON).train_with_join(model, batches, optimizer,
                                                  mse_of_output_and_target)
    torch.manual_seed(0)
    reference = DDP(nn.Linear(3, 1))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    with Join([reference]):
        for inputs, targets in batches:
            reference_optimizer.zero_grad()
            nn.functional.mse_loss(reference(inputs), targets).backward()
            reference_optimizer.step()
    return {"steps": steps, "batches": len(batches), "weights": model.module.state_dict(),
            "reference": reference.module.state_dict()}


@pytest.mark.task4_4
def test_train_with_join_trains_every_batch_without_hanging(ex):
    """On 2 gloo ranks with 2 and 4 batches, `train_with_join` returns without hanging (a 5 s
    process-group timeout), takes one step per batch on each rank, and ends with the weights of a
    reference loop under `Join`."""
    raise_if_untouched(ex.train_with_join)  # not attempted: no ranks
    try:
        results = run_on_ranks(joining_on_rank, pg_timeout=GRADE_TIMEOUT, timeout=40)
    except RankError as error:
        raise AssertionError(
            f"the ranks hung (process-group timeout {GRADE_TIMEOUT} s): rank 1 has more batches; "
            f"wrap the loop in Join([model]) so the finished rank answers its all-reduces."
            f"\n{error}") from None
    for rank, r in enumerate(results):
        assert r["steps"] == r["batches"], (
            f"rank {rank} returned {r['steps']} steps for its {r['batches']} batches: train on "
            f"every batch (Join lets the ranks take different numbers of steps)")
    for rank, r in enumerate(results):
        assert_parameters_close(r["weights"], r["reference"], rank=rank,
                                what="weight after train_with_join vs a Join reference")
