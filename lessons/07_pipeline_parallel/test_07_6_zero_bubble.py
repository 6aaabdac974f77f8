"""task7_6, zero bubble (ZB-H1): 1F1B with each backward split into the input's gradient (B)
and the weights' (W), the W's held back to fill the bubble; held to the order torch's
ScheduleInterleavedZeroBubble builds with one stage per rank, for every shape generated, and run
through the lesson's simulator.

    pytest lessons/07_pipeline_parallel -m task7_6
"""

from __future__ import annotations

import functools

import pytest

from harness.exercises import raise_if_untouched
from harness.ranks import in_a_child
from harness.sweep import st, sweep
from lesson07.common import torch_orders as torch_built
from lesson07.simulator import Deadlock, ScheduleError, reference_schedule, simulate

# The task's contract, clause by clause, and the tests that fail when only that clause is
# broken (tests/test_course.py checks the names).
CLAUSES = {
    "task7_6": {
        "result[s] is stage s's list of ('F', i), ('B', i) and ('W', i), in order": [
            "test_zero_bubble_is_torchs_order", "test_zero_bubble_of_any_shape_is_torchs"],
        "stage s first runs min(p - s - 1, m) forwards (any m: no rounds)": [
            "test_zero_bubble_is_torchs_order", "test_zero_bubble_of_any_shape_is_torchs"],
        "then for each j: the next forward while any are left, then ('B', j)": [
            "test_zero_bubble_is_torchs_order", "test_zero_bubble_of_any_shape_is_torchs"],
        "then, once j >= s, the W of the oldest micro-batch whose W has not run": [
            "test_zero_bubble_is_torchs_order", "test_zero_bubble_of_any_shape_is_torchs",
            "test_zero_bubble_runs_in_the_simulator_with_a_third_of_1f1bs_bubble"],
        "then the W's left, oldest first": [
            "test_zero_bubble_is_torchs_order", "test_zero_bubble_of_any_shape_is_torchs"],
        "each stage runs each micro-batch's F, B and W exactly once, in that order": [
            "test_zero_bubble_runs_in_the_simulator_with_a_third_of_1f1bs_bubble",
            "test_zero_bubble_of_any_shape_is_torchs"],
        "fewer than 1 stage or 1 micro-batch raise ValueError": [
            "test_zero_bubble_rejects_what_is_not_a_pipeline"],
    },
}

# The sweep's bounds: torch's order for every shape within them is read once, in a child.
MAX_STAGES, MAX_MICRO_BATCHES = 6, 16


@functools.cache
def torch_orders() -> dict:
    """torch's order per (p, m), its chunk left out (one stage per rank); read once, when a
    test first needs it (an untouched stub never does)."""
    built = in_a_child(torch_built, "zero-bubble", MAX_STAGES, 1, MAX_MICRO_BATCHES, timeout=120)
    return {(p, m): None if order is None else [[(k, i) for k, i, _ in actions]
                                                for actions in order]
            for (p, _, m), order in built.items()}


# (stages, micro-batches): the text's picture; m = p; m < p; one stage; uneven m; one that
# torch's interleaved form refuses (9 is not 2 rounds), which one stage per rank does not need
SHAPES = [(4, 8), (2, 4), (4, 4), (4, 2), (1, 3), (3, 5), (5, 10), (4, 9)]


@pytest.mark.task7_6
@pytest.mark.parametrize("stages,micro_batches", SHAPES, ids=[f"p{p}-m{m}" for p, m in SHAPES])
def test_zero_bubble_is_torchs_order(ex, stages, micro_batches):
    """zero_bubble(p, m) is ZB-H1 as torch builds it: each stage's list against the pipeline_order
    of ScheduleInterleavedZeroBubble with one stage per rank (a fake process group) on 8 shapes,
    among them m < p, m = p, one stage; for 4 stages and 9 micro-batches, which torch refuses, the
    same rule."""
    raise_if_untouched(ex.zero_bubble)
    assert_torchs_order(ex, stages, micro_batches)


@pytest.mark.task7_6
@sweep(stages=st.integers(1, MAX_STAGES), micro_batches=st.integers(1, MAX_MICRO_BATCHES),
       max_examples=60)
def test_zero_bubble_of_any_shape_is_torchs(ex, stages, micro_batches):
    """zero_bubble is torch's order on 60 generated shapes (p <= 6, m <= 16); where torch refuses
    the shape (m not a multiple of its rounds, which only its interleaved form needs), the same
    rule, which tests/test_torch_claims.py holds equal to torch's wherever torch builds one."""
    raise_if_untouched(ex.zero_bubble)
    assert_torchs_order(ex, stages, micro_batches)


@pytest.mark.task7_6
@pytest.mark.parametrize("stages,micro_batches", [(4, 8), (2, 4), (3, 3), (4, 16)],
                         ids=["p4-m8", "p2-m4", "p3-m3", "p4-m16"])
def test_zero_bubble_runs_in_the_simulator_with_a_third_of_1f1bs_bubble(ex, stages,
                                                                         micro_batches):
    """ZB-H1 runs in the simulator with a forward, a B and a W of equal time without deadlock, idle
    (p - 1) / (3 m + p - 1) of the time, no stage holding more than p micro-batches' activations
    (each held until its W): 4 shapes with m >= p."""
    raise_if_untouched(ex.zero_bubble)
    plan = ex.zero_bubble(stages, micro_batches)
    call = f"zero_bubble({stages}, {micro_batches})"
    assert_shape(plan, call, stages)
    try:
        timeline = simulate([list(map(tuple, actions)) for actions in plan], micro_batches,
                            backward_time=2.0, weight_time=1.0, posting=None)
    except Deadlock as error:
        raise AssertionError(f"{call} deadlocks: {error}") from None
    except ScheduleError as error:
        raise AssertionError(f"{call} is not a schedule: {error}") from None
    bubble = (stages - 1) / (3 * micro_batches + stages - 1)
    assert timeline.bubble_fraction() == pytest.approx(bubble), (
        f"{call}: the stages are idle {timeline.bubble_fraction():.1%} of the time, expected "
        f"(p - 1) / (3 m + p - 1) = {bubble:.1%}: a W that could fill a wait runs too late, "
        f"or one runs where a B is waited for")
    for stage in range(stages):
        held = timeline.peak_in_flight(stage)
        assert held <= stages, (
            f"{call}: stage {stage} holds the activations of up to {held} micro-batches at "
            f"once (each until its W), more than p = {stages}, 1F1B's most: it holds back "
            f"more W's than the s it may")


@pytest.mark.task7_6
@pytest.mark.parametrize("arguments", [(0, 4), (2, 0), (-1, 4), (2, -3)],
                         ids=["no-stages", "no-micro-batches", "negative-stages",
                              "negative-micro-batches"])
def test_zero_bubble_rejects_what_is_not_a_pipeline(ex, arguments):
    """zero_bubble raises ValueError for 0 or negative stages or micro-batches."""
    raise_if_untouched(ex.zero_bubble)
    try:
        got = ex.zero_bubble(*arguments)
    except ValueError:
        return
    except Exception as error:  # noqa: BLE001 - the wrong kind of error is the finding
        raise AssertionError(f"zero_bubble{arguments} raised {type(error).__name__}: {error}; "
                             f"raise ValueError") from None
    raise AssertionError(f"zero_bubble{arguments} returned {got!r:.80}: raise ValueError")


def assert_shape(plan, call: str, stages: int) -> None:
    __tracebackhide__ = True
    assert isinstance(plan, list) and len(plan) == stages, (
        f"{call} returned {type(plan).__name__} of length "
        f"{len(plan) if hasattr(plan, '__len__') else '?'}; expected a list with one list of "
        f"actions per stage")
    for stage, actions in enumerate(plan):
        for action in actions:
            assert isinstance(action, (tuple, list)) and len(action) == 2, (
                f"{call}: stage {stage} has the action {action!r}; each is ('F', i), ('B', i) "
                f"or ('W', i)")


def assert_torchs_order(ex, stages: int, micro_batches: int) -> None:
    __tracebackhide__ = True
    call = f"zero_bubble({stages}, {micro_batches})"
    want = torch_orders()[stages, micro_batches]
    source = "torch's ScheduleInterleavedZeroBubble"
    if want is None:  # torch refuses the shape; the rule it follows elsewhere
        want, source = reference_schedule("zero-bubble", stages, micro_batches), "the rule"
    try:
        got = ex.zero_bubble(stages, micro_batches)
    except ValueError as error:
        raise AssertionError(f"{call} raised ValueError ({error}): with one stage per rank there "
                             f"are no rounds to fill; only fewer than 1 stage or 1 micro-batch "
                             f"raise") from None
    assert_shape(got, call, stages)
    for stage in range(stages):
        mine = [tuple(action) for action in got[stage]]
        if mine != want[stage]:
            raise AssertionError(f"{call}: stage {stage} runs {_show(mine)}; {source} runs "
                                 f"{_show(want[stage])}. "
                                 + diagnose(mine, want[stage], stages, micro_batches, stage))


def diagnose(got: list, want: list, stages: int, micro_batches: int, stage: int) -> str:
    """Which rule of the docstring the stage's actions break first."""
    def leading(actions: list) -> int:
        return next((i for i, a in enumerate(actions) if a[0] != "F"), len(actions))

    warmup = min(stages - stage - 1, micro_batches)
    if leading(got) != leading(want):
        return (f"It runs {leading(got)} forwards before its first B, torch {leading(want)}: "
                f"the warm-up is min(p - s - 1, m) = {warmup}, as 1F1B's, and one more forward "
                f"comes before the first B")
    if [a for a in got if a[0] != "W"] != [a for a in want if a[0] != "W"]:
        return ("Without its W's, a stage runs 1F1B's order: the warm-up, then the next forward "
                "(while any are left) and B j, for j = 0, 1, ...")

    def after_each_b(actions: list) -> list[bool]:
        return [a[0] == "B" and i + 1 < len(actions) and actions[i + 1][0] == "W"
                for i, a in enumerate(actions) if a[0] == "B"]

    mine, theirs = after_each_b(got), after_each_b(want)
    if mine != theirs:
        j = next(j for j, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b)
        return (f"{'A W follows' if mine[j] else 'No W follows'} its B {j}: stage s = {stage} "
                f"holds back its first s W's, so a W follows B j once j >= s and not before "
                f"(the held-back W's fill the wait for the gradients at the end of the step)")
    order = [i for k, i in got if k == "W"]
    if order != sorted(order):
        return f"Its W's run the micro-batches {order}: each W is the oldest that has not run"
    return "Its W's left at the end run last, oldest first"


def _show(actions: list) -> str:
    text = ", ".join(f"{k}{i}" for k, i in actions[:16])
    return f"[{text}{', ...' if len(actions) > 16 else ''}]"
