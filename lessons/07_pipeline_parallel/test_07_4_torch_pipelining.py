"""task7_4, torch's pipelining: torch_schedule and torch_step train like the unsplit model
through torch.distributed.pipelining, each stage passing only what it uses.

    pytest lessons/07_pipeline_parallel -m task7_4
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from harness.compare import assert_close
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
    one_process,
    train_stage,
)

# The task's contract, clause by clause, and the tests that fail when only that clause is
# broken (tests/test_course.py checks the names).
CLAUSES = {
    "task7_4": {
        "torch_schedule wraps module in PipelineStage(module, stage, num_stages, device)": [
            "test_torch_pipelining_trains_like_one_process"],
        "kind='1f1b' gives Schedule1F1B": ["test_torch_pipelining_trains_like_one_process"],
        "kind='gpipe' gives ScheduleGPipe": ["test_torch_pipelining_trains_like_one_process"],
        "kind defaults to '1f1b'": ["test_torch_schedule_is_1f1b_when_no_kind_is_given"],
        "with n_microbatches=num_micro_batches and loss_fn": [
            "test_torch_pipelining_trains_like_one_process"],
        "torch averages the micro-batches' gradients (scale_grads=True)": [
            "test_torch_pipelining_trains_like_one_process"],
        "torch_step: the first stage passes the whole batch's inputs": [
            "test_torch_pipelining_trains_like_one_process",
            "test_torch_step_passes_each_stage_only_what_it_uses"],
        "torch_step: the last its targets and a list for the losses": [
            "test_torch_pipelining_trains_like_one_process",
            "test_torch_step_passes_each_stage_only_what_it_uses"],
        "torch_step: a middle stage nothing": [
            "test_torch_pipelining_trains_like_one_process",
            "test_torch_step_passes_each_stage_only_what_it_uses"],
        "torch_step: a single stage passes both": [
            "test_torch_step_on_a_single_stage_passes_the_inputs_and_the_targets"],
        "torch_step returns the last stage's micro-batch losses as floats": [
            "test_torch_pipelining_trains_like_one_process"],
        "torch_step returns an empty list on the other stages": [
            "test_torch_pipelining_trains_like_one_process"],
    },
}


def torch_pipeline_run(ctx, kind: str, m: int, steps: int):
    ex = load_exercise(LESSON)
    model = make_gpt().to(ctx.device)
    stage = my_stage(model, ctx.rank, ctx.world_size)
    schedule = ex.torch_schedule(stage, ctx.rank, ctx.world_size, m, next_token_loss,
                                 ctx.device, kind=kind)

    def one_step(step: int) -> list[float]:
        inputs, targets = (t.to(ctx.device) for t in batch(step))
        return ex.torch_step(schedule, ctx.rank, ctx.world_size, inputs, targets)

    return {**train_stage(model, stage, one_step, steps), "type": type(schedule).__name__}


TORCH_CASES = [(2, "1f1b", 4), (2, "gpipe", 2), (4, "1f1b", 4), (4, "gpipe", 4)]


@pytest.mark.task7_4
@pytest.mark.parametrize("world,kind,m", TORCH_CASES,
                         ids=[f"p{w}-{k}-m{m}" for w, k, m in TORCH_CASES])
def test_torch_pipelining_trains_like_one_process(ex, world, kind, m):
    """torch_schedule and torch_step take the unsplit model's steps: Schedule1F1B and ScheduleGPipe
    (their type checked) on 2 and 4 gloo ranks, every stage's gradients and parameters after 2 SGD
    steps and the last stage's losses, as floats, against one process.

    task7_2's test holds the hand-written runner to the same reference."""
    raise_if_untouched(ex.torch_schedule, ex.torch_step)
    results = run_on_ranks(torch_pipeline_run, kind, m, STEPS, world_size=world, timeout=60)
    expected = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}[kind]
    for rank, got in enumerate(results):
        assert got["type"] == expected, (
            f"rank {rank}: torch_schedule(kind={kind!r}) made a {got['type']}, not {expected}")
    assert_trains_like_one_process(results, f"torch's {expected}, {world} stages, {m} "
                                   f"micro-batches", m)
    assert_close(torch.tensor(results[-1]["losses"]), torch.tensor(one_process()["losses"][m]),
                 "the last stage's micro-batch losses from torch_step", world - 1)
    assert all(type(loss) is float for loss in results[-1]["losses"]), (
        f"torch_step should return the losses as floats (.item()), not "
        f"{type(results[-1]['losses'][0]).__name__}")
    for rank, got in enumerate(results[:-1]):
        assert got["losses"] == [], f"rank {rank}: a stage before the last returned losses"


def torch_default_kind_run(ctx) -> str:
    ex = load_exercise(LESSON)
    schedule = ex.torch_schedule(nn.Linear(4, 4), ctx.rank, ctx.world_size, 2,
                                 lambda out, target: ((out - target) ** 2).mean(), ctx.device)
    return type(schedule).__name__


@pytest.mark.task7_4
def test_torch_schedule_is_1f1b_when_no_kind_is_given(ex):
    """torch_schedule given no kind makes a Schedule1F1B (a pipeline of one rank)."""
    raise_if_untouched(ex.torch_schedule)
    made = run_on_ranks(torch_default_kind_run, world_size=1)[0]
    assert made == "Schedule1F1B", (
        f"torch_schedule(...) without kind made a {made}: kind defaults to \"1f1b\", "
        f"Schedule1F1B")


def torch_single_stage_run(ctx, m: int, steps: int) -> dict:
    """The whole model as the one stage of a pipeline, through torch_schedule and torch_step."""
    ex = load_exercise(LESSON)
    model = make_gpt()
    stage = my_stage(model, 0, 1)
    schedule = ex.torch_schedule(stage, 0, 1, m, next_token_loss, ctx.device, kind="1f1b")

    def one_step(step: int) -> list[float]:
        return ex.torch_step(schedule, 0, 1, *batch(step))

    return train_stage(model, stage, one_step, steps)


@pytest.mark.task7_4
def test_torch_step_on_a_single_stage_passes_the_inputs_and_the_targets(ex):
    """On a pipeline of one stage, torch_step passes both the inputs and the targets: Schedule1F1B
    with 4 micro-batches takes the unsplit model's 2 SGD steps and gives its micro-batch losses."""
    raise_if_untouched(ex.torch_schedule, ex.torch_step)
    try:
        results = run_on_ranks(torch_single_stage_run, 4, STEPS, world_size=1, timeout=60)
    except RankError as error:
        raise AssertionError(
            "torch_step on a pipeline of one stage failed. That stage is the first and the "
            "last: it passes the inputs and the targets and a list for the losses, "
            "schedule.step(inputs, target=targets, losses=losses):\n" + str(error)[:1500]
        ) from None
    assert_trains_like_one_process(results, "torch's Schedule1F1B, 1 stage, 4 micro-batches", 4)
    assert_close(torch.tensor(results[0]["losses"]), torch.tensor(one_process()["losses"][4]),
                 "the single stage's micro-batch losses from torch_step")


class RecordedSchedule:
    """Stands in for a torch schedule: notes what ``step`` is given, and on the last stage
    fills the losses list as torch does."""

    def __init__(self):
        self.calls: list[tuple[tuple, dict]] = []

    def step(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if isinstance(kwargs.get("losses"), list) and kwargs.get("target") is not None:
            kwargs["losses"].extend(torch.tensor(0.5) for _ in range(2))


@pytest.mark.task7_4
@pytest.mark.parametrize("stage", [0, 1, 2], ids=["first", "middle", "last"])
def test_torch_step_passes_each_stage_only_what_it_uses(ex, stage):
    """torch_step calls schedule.step once with what each stage of three uses (the first stage the
    inputs alone, a middle one nothing, the last the targets and a list for the losses), and
    returns the losses as floats on the last stage and [] elsewhere, against a stand-in schedule
    that records its calls."""
    raise_if_untouched(ex.torch_step)
    schedule = RecordedSchedule()
    inputs, targets = batch(0)
    where = ["the first", "a middle", "the last"][stage] + " stage of 3"
    got = ex.torch_step(schedule, stage, 3, inputs, targets)
    assert len(schedule.calls) == 1, (
        f"torch_step on {where} called schedule.step {len(schedule.calls)} times; once")
    args, kwargs = schedule.calls[0]
    passed_inputs = any(a is inputs for a in args) or any(v is inputs for v in kwargs.values())
    passed_targets = kwargs.get("target") is targets or any(a is targets for a in args)
    if stage == 0:
        assert passed_inputs and not passed_targets, (
            f"torch_step on {where} called schedule.step(*{len(args)} args, keywords "
            f"{sorted(kwargs)}); the first stage (not also the last) passes the inputs alone, "
            f"schedule.step(inputs): the targets belong to the last stage")
        assert got == [], f"torch_step on {where} returned {got!r}; expected []"
    elif stage == 1:
        assert not args and not kwargs, (
            f"torch_step on {where} called schedule.step(*{len(args)} args, keywords "
            f"{sorted(kwargs)}); a middle stage passes nothing, schedule.step()")
        assert got == [], f"torch_step on {where} returned {got!r}; expected []"
    else:
        assert not passed_inputs and not args and passed_targets and isinstance(
            kwargs.get("losses"), list), (
            f"torch_step on {where} called schedule.step(*{len(args)} args, keywords "
            f"{sorted(kwargs)}); the last stage (not also the first) passes no inputs, only "
            f"the targets and a list for the losses, schedule.step(target=targets, "
            f"losses=losses)")
        assert got == [0.5, 0.5] and all(isinstance(x, float) for x in got), (
            f"torch_step on {where} returned {got!r}; expected the losses torch put in the "
            f"list, as floats: [0.5, 0.5]")


