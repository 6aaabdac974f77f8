"""task7_7, pipeline x data parallel: average_over_copies averages each stage's gradients over
the copies of that stage (mesh["dp"]), checked on known gradients over meshes of every shape
and order, then in a 2 x 2 training run of the running example against one process.

    pytest lessons/07_pipeline_parallel -m task7_7
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from harness.exercises import load_exercise, raise_if_untouched
from harness.ranks import RankError, run_on_ranks
from lesson07.common import (
    LESSON,
    STEPS,
    assert_trains_like_one_process,
    batch,
    make_gpt,
    my_stage,
    next_token_loss,
    train_stage,
)

# The task's contract, clause by clause, and the tests that fail when only that clause is
# broken (tests/test_course.py checks the names).
CLAUSES = {
    "task7_7": {
        "average each gradient over the copies of this stage: all-reduce over mesh['dp']": [
            "test_average_over_copies_averages_each_stage_over_its_copies",
            "test_a_pipeline_of_data_parallel_stages_trains_like_one_process"],
        "divided by that group's size": [
            "test_average_over_copies_averages_each_stage_over_its_copies"],
        "the dimensions in either order": [
            "test_average_over_copies_averages_each_stage_over_its_copies"],
        "not over the world, whose other ranks hold other stages": [
            "test_average_over_copies_averages_each_stage_over_its_copies"],
        "a 'dp' dimension of size 1 leaves the gradients as they are": [
            "test_average_over_copies_averages_each_stage_over_its_copies"],
        "parameters without a gradient are skipped": [
            "test_average_over_copies_averages_each_stage_over_its_copies"],
    },
}


def known_gradients(ctx, sizes: tuple[int, int], names: tuple[str, str]) -> dict:
    """Every rank holds a stage of the same shapes (so that a wrong group gives wrong numbers,
    not a crash), with gradients (10 s + d + 1) x a shared pattern on stage s, copy d."""
    ex = load_exercise(LESSON)
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
    stage, copy = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    module = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2), nn.Linear(2, 1))
    module[1].bias.requires_grad_(False)  # parameters without a gradient: a frozen one, and
    unused = module[2].weight  # a trainable one that took no part in the step
    pattern = torch.Generator().manual_seed(0)
    for parameter in module.parameters():
        if parameter.requires_grad and parameter is not unused:
            parameter.grad = (10 * stage + copy + 1) * torch.randn(parameter.shape,
                                                                  generator=pattern)
    ex.average_over_copies(module, mesh)
    pattern = torch.Generator().manual_seed(0)
    factors = []
    for parameter in module.parameters():
        if parameter.requires_grad and parameter is not unused:
            base = torch.randn(parameter.shape, generator=pattern)
            factors.append(float((parameter.grad * base).sum() / (base * base).sum()))
            if not torch.allclose(parameter.grad, factors[-1] * base, atol=1e-5):
                factors[-1] = float("nan")  # not a multiple of the pattern: mixed up
    return {"stage": stage, "copy": copy, "factors": factors, "rank": dist.get_rank(),
            "skipped": module[1].bias.grad is None and unused.grad is None}


MESHES = [((2, 2), ("pp", "dp")), ((2, 2), ("dp", "pp")), ((4, 1), ("pp", "dp")),
          ((1, 4), ("pp", "dp")), ((4, 1), ("dp", "pp")), ((1, 4), ("dp", "pp"))]


@pytest.mark.task7_7
@pytest.mark.parametrize("sizes,names", MESHES,
                         ids=["pp2-dp2", "dp2-pp2", "pp4-dp1", "pp1-dp4", "dp4-pp1", "dp1-pp4"])
def test_average_over_copies_averages_each_stage_over_its_copies(ex, sizes, names):
    """average_over_copies averages each gradient over its stage's copies only: known gradients on
    4 gloo ranks over meshes of 2 x 2, 4 x 1 and 1 x 4 (both orders), each rank's against the mean
    over mesh["dp"], a wrong group or divisor named; parameters without a gradient skipped.

    It also checks torch's layout of the ranks, the last dimension varying fastest, which the
    README's picture shows."""
    raise_if_untouched(ex.average_over_copies)
    try:
        results = run_on_ranks(known_gradients, sizes, names, world_size=4, timeout=60)
    except RankError as error:
        hint = (": a parameter without a gradient (grad None) is skipped"
                if "NoneType" in str(error) else "")
        raise AssertionError(f"average_over_copies failed on a mesh of {sizes} named "
                             f"{names}{hint}:\n{str(error)[:1500]}") from None
    shape = dict(zip(names, sizes, strict=True))
    pp, dp = shape["pp"], shape["dp"]
    mesh = f"a mesh of {sizes} named {names}"
    every = [10 * r["stage"] + r["copy"] + 1 for r in results]
    for rank, got in enumerate(results):
        s = got["stage"]
        mine = [10 * s + d + 1 for d in range(dp)]
        want = sum(mine) / dp
        wrong = {"summed over the copies but not divided by their number": sum(mine),
                 "averaged over the whole world, whose other ranks hold other stages":
                     sum(every) / len(every),
                 "all-reduced over the whole world, whose other ranks hold other stages":
                     sum(every) / dp,
                 "divided by the world's size (or averaged twice), not once by the number of "
                 "copies": sum(mine) / 4,
                 "averaged over the pipeline (mesh['pp']), the other stages, not the copies":
                     sum(10 * t + got["copy"] + 1 for t in range(pp)) / pp,
                 "averaged twice (ReduceOp.AVG, then divided again)": want / dp,
                 "left as they were": 10 * s + got["copy"] + 1}
        for factor in got["factors"]:
            if factor == pytest.approx(want, rel=1e-4):
                continue
            named = next((why for why, value in wrong.items()
                          if value != pytest.approx(want, rel=1e-4)
                          and factor == pytest.approx(value, rel=1e-4)), None)
            raise AssertionError(
                f"{mesh}: rank {rank} (stage {s}, copy {got['copy']}) has gradients {factor:g} x "
                f"the pattern; the average over its stage's {dp} copies is {want:g}"
                + (f": they were {named}" if named else
                   ": all-reduce each over mesh['dp'].get_group() and divide by its size"))
        assert got["skipped"], (
            f"{mesh}: rank {rank}: a parameter without a gradient has one now; skip it")
        # torch's layout, which the README's picture shows: the last dimension varies fastest
        inner = got["copy"] if names[-1] == "dp" else got["stage"]
        outer = got["stage"] if names[-1] == "dp" else got["copy"]
        assert rank == outer * sizes[-1] + inner, (rank, got, sizes, names)


def pipeline_of_copies(ctx, pp: int, m: int, steps: int) -> dict:
    """2 copies of a pp-stage 1F1B pipeline of the running example: torch's Schedule1F1B over
    mesh["pp"], each copy on its half of the batch, the learner's average after each step."""
    ex = load_exercise(LESSON)
    dp = ctx.world_size // pp
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    s, d = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    model = make_gpt()
    module = my_stage(model, s, pp)
    stage = PipelineStage(module, s, pp, ctx.device, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, m, loss_fn=next_token_loss)

    def one_step(step: int) -> list[float]:
        inputs, targets = (t.chunk(dp)[d].contiguous() for t in batch(step))
        losses: list = []
        if s == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=targets, losses=losses)
        ex.average_over_copies(module, mesh)
        return [loss.item() for loss in losses]

    return train_stage(model, module, one_step, steps)


@pytest.mark.task7_7
def test_a_pipeline_of_data_parallel_stages_trains_like_one_process(ex):
    """2 copies of a 2-stage pipeline train as one process: torch's Schedule1F1B over mesh["pp"] on
    4 gloo ranks, each copy on half of every batch, average_over_copies after each step; every
    rank's stage after each of 2 SGD steps against the unsplit model on the whole batch."""
    raise_if_untouched(ex.average_over_copies)
    try:
        results = run_on_ranks(pipeline_of_copies, 2, 2, STEPS, world_size=4, timeout=90)
    except RankError as error:
        mixed = any(word in str(error).lower() for word in ("size", "shape", "mismatch"))
        hint = (" An all-reduce over the world mixes stage 0's gradients with stage 1's, of "
                "other shapes: average over mesh['dp'].get_group() only." if mixed else "")
        raise AssertionError("2 copies of a 2-stage pipeline failed in average_over_copies or "
                             f"after it.{hint}\n" + str(error)[:1500]) from None
    assert_trains_like_one_process(results, "2 copies of a 2-stage pipeline, each on half "
                                   "of the batch", 2)
