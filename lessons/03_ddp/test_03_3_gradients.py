"""Grades task3_3, average_gradients: on 2 and 3 ranks, the averaged gradients are those of one
process on the whole batch.

    pytest lessons/03_ddp -m task3_3
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.compare import assert_parameters_close, full_fp32
from harness.exercises import load_exercise
from harness.ranks import run_on_ranks
from lesson03.common import (
    GROUPS,
    LESSON,
    make_data,
    make_model,
    my_share,
    single_process_gradients,
    with_diagnosis,
)

# This task's contract, clause by clause, and the tests that fail when only that clause
# is broken (tests/test_course.py checks the names).
CLAUSES = {
    "task3_3": {
        "replace every gradient by its mean over all ranks, in place": [
            "test_average_gradients_equal_one_process_on_the_whole_batch"],
        "parameters without a gradient are skipped": [
            "test_average_gradients_skips_parameters_without_a_gradient"],
    },
}


def hand_averaged_gradients(ctx, inputs, targets):
    with full_fp32():  # compared with a CPU run: no TF32
        model = make_model().to(ctx.device)
        x, y = my_share(ctx, inputs, targets)
        nn.functional.mse_loss(model(x), y).backward()
        local = {name: p.grad.clone() for name, p in model.named_parameters()}
        load_exercise(LESSON).average_gradients(model)
        return {"averaged": {name: p.grad for name, p in model.named_parameters()}, "local": local}


def averaging_diagnosis(got: dict, local: dict) -> str:
    """The mistake a wrong scale cannot show (harness.compare names those): no averaging."""
    if any(got.get(name) is None for name in local):
        return ""
    if all(torch.allclose(got[name].double(), local[name].double(), rtol=1e-5, atol=1e-7)
           for name in local):
        return ("each rank kept its own gradient: nothing was all-reduced into param.grad "
                "(all-reduce param.grad itself, in place, or copy the result back into it)")
    return ""


@pytest.mark.task3_3
@pytest.mark.parametrize("group", GROUPS)
def test_average_gradients_equal_one_process_on_the_whole_batch(group):
    """After backward on each rank's 4 samples, average_gradients leaves every rank one process's
    gradients on the whole batch (MSE, fp32 tolerance): on 2 and 3 gloo ranks on the CPU, and on
    GPUs.

    The GPU cases: 2 gloo ranks sharing cuda:0, and nccl with one rank per GPU."""
    world, backend, device = group
    inputs, targets = make_data(4 * world)
    expected = single_process_gradients(inputs, targets)
    results = run_on_ranks(hand_averaged_gradients, inputs, targets, world_size=world,
                           backend=backend, device=device)
    for rank, result in enumerate(results):
        try:
            assert_parameters_close(result["averaged"], expected, rank=rank,
                                    what="averaged gradient")
        except AssertionError as error:
            why = averaging_diagnosis(result["averaged"], result["local"])
            if not why:
                raise
            raise with_diagnosis(error, why) from None


def averaged_with_an_unused_parameter(ctx):
    """average_gradients on a model one of whose parameters backward never reached."""
    model = make_model()
    unused = nn.Parameter(torch.ones(3))
    model.register_parameter("unused", unused)
    x, y = make_data(4, seed=ctx.rank)
    nn.functional.mse_loss(model(x), y).backward()
    try:
        load_exercise(LESSON).average_gradients(model)
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the learner's error is the finding
        return {"error": f"{type(error).__name__}: {error}", "grad": None}
    return {"error": None, "grad": unused.grad}


@pytest.mark.task3_3
def test_average_gradients_skips_parameters_without_a_gradient():
    """average_gradients on 2 gloo ranks skips a parameter that backward never reached: no error,
    and its .grad stays None."""
    results = run_on_ranks(averaged_with_an_unused_parameter, world_size=2)
    for rank, result in enumerate(results):
        assert result["error"] is None, (
            f"rank {rank}: average_gradients raised {result['error']} on a model with a "
            f"parameter that backward never reached (its .grad is None): skip it")
        assert result["grad"] is None, (
            f"rank {rank}: the unused parameter's .grad became {result['grad']}: leave a "
            f"parameter without a gradient as it is (None)")
