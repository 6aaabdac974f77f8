"""Every sharded method beside DDP where the plain case hides a mistake: accumulated backwards
(DDP under no_sync), shares of different sizes, parameters with fewer elements than there are
ranks. Each test is parametrised over the methods, each marked with its own task: ZeRO-1
(task5_2), ZeRO-2 (task5_3) and FSDP2 (task5_4).

    pytest lessons/05_sharded_data_parallel -m task5_3   # or task5_2, task5_4
"""

from __future__ import annotations

import pytest

from harness.exercises import raise_if_untouched
from harness.ranks import run_on_ranks
from lesson05.common import (
    accumulate_beside_ddp,
    assert_same_as_ddp,
    one_process,
    train_beside_ddp,
    with_diagnosis,
)

# Shares of different sizes, and parameters smaller than the world: each method beside DDP.
EDGE_METHODS = [pytest.param("zero1", "Zero1Optimizer", marks=pytest.mark.task5_2, id="zero1"),
                pytest.param("zero2", "Zero2Optimizer", marks=pytest.mark.task5_3, id="zero2"),
                pytest.param("fsdp", "shard_model", marks=pytest.mark.task5_4, id="fsdp")]


ACCUMULATION_HINTS = {
    "zero1": "the step must reduce the gradients the backwards accumulated in param.grad",
    "zero2": ("if the steps without accumulation pass (the test above), the hook replaces "
              "the piece's .grad instead of adding to it, so only the last micro-batch "
              "counts: add the reduced piece to it (or make it the .grad when there is none)"),
    "fsdp": ("FSDP2 accumulates by itself: shard_model must return the model fully_shard "
             "made, whose set_requires_gradient_sync the training loop calls"),
}


@pytest.mark.parametrize("method,graded", EDGE_METHODS)
@pytest.mark.parametrize("micro_batches", [2, 3])
def test_accumulated_backwards_then_one_step_equal_ddp_with_no_sync(ex, method, graded,
                                                                   micro_batches):
    """2 and 3 accumulated backwards, then one step, equal DDP's under `no_sync()`: 2 AdamW
    steps on 2 gloo ranks, for ZeRO-1, ZeRO-2 and FSDP2 (which syncs only the last,
    `set_requires_gradient_sync`)."""
    raise_if_untouched(getattr(ex, graded))  # a stub: not attempted, without starting ranks
    results = run_on_ranks(accumulate_beside_ddp, method, micro_batches, world_size=2)
    for rank, result in enumerate(results):
        try:
            assert_same_as_ddp(result, rank, 2, f"{method}, {micro_batches} accumulated "
                                                 f"backwards per step")
        except AssertionError as error:
            raise with_diagnosis(error, ACCUMULATION_HINTS[method]) from None


@pytest.mark.parametrize("method,graded", EDGE_METHODS)
def test_shares_of_different_sizes_train_as_ddp_does(ex, method, graded):
    """With shares of 5, 4 and 3 of 12 sequences on 3 gloo ranks, ZeRO-1, ZeRO-2 and FSDP2 take
    DDP's 2 AdamW steps.

    Each rank averages its own share: the mean of those means is not one process's mean over all
    12, for DDP and for every sharded method alike. What must hold is that the method takes
    DDP's steps."""
    raise_if_untouched(getattr(ex, graded))  # a stub: not attempted, without starting ranks
    results = run_on_ranks(train_beside_ddp, method, "adamw", 2, "gpt", uneven=True,
                           world_size=3)
    for rank, result in enumerate(results):
        assert_same_as_ddp(result, rank, 3, f"{method}, shares of 5, 4 and 3 sequences")


@pytest.mark.parametrize("method,graded", EDGE_METHODS)
def test_more_ranks_than_elements_in_a_parameter(ex, method, graded):
    """With a 3-element weight and a 1-element bias on 4 gloo ranks, where some pieces (and, in
    FSDP2, some rows) are empty, ZeRO-1, ZeRO-2 and FSDP2 take DDP's and one process's 2 AdamW
    steps."""
    raise_if_untouched(getattr(ex, graded))  # a stub: not attempted, without starting ranks
    results = run_on_ranks(train_beside_ddp, method, "adamw", 2, "stack", world_size=4)
    for rank, result in enumerate(results):
        assert_same_as_ddp(result, rank, 4, f"{method}, parameters of 3 and 1 elements",
                           one_process("stack", 2))
