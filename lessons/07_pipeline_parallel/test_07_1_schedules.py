"""task7_1, the schedules: each stage's list of actions for GPipe and 1F1B, of any shape, run
through the lesson's simulator (no deadlock; the bubble and the activations in flight the text
gives) and against the text's definitions.

    pytest lessons/07_pipeline_parallel -m task7_1
"""

from __future__ import annotations

import pytest

from harness.sweep import st, sweep
from lesson07.simulator import (
    Deadlock,
    OrderMismatch,
    ScheduleError,
    reference_schedule,
    simulate,
)

# The task's contract, clause by clause, and the tests that fail when only that clause is
# broken (tests/test_course.py checks the names).
CLAUSES = {
    "task7_1": {
        "result[s] is stage s's list of actions, in the order it runs them": [
            "test_schedule_runs_without_deadlock_with_the_bubble_and_memory_of_the_text",
            "test_schedule_of_any_shape_is_the_texts"],
        "gpipe: every forward, micro-batches 0 to m - 1, then every backward": [
            "test_schedule_runs_without_deadlock_with_the_bubble_and_memory_of_the_text",
            "test_schedule_of_any_shape_is_the_texts"],
        "gpipe: the backwards last micro-batch first, the reverse of the forwards": [
            "test_schedule_of_any_shape_is_the_texts"],
        "1f1b: stage s first runs min(p - s - 1, m) forwards (the warm-up)": [
            "test_schedule_runs_without_deadlock_with_the_bubble_and_memory_of_the_text",
            "test_schedule_of_any_shape_is_the_texts"],
        "1f1b: then one forward and one backward, oldest first, then the remaining backwards": [
            "test_schedule_runs_without_deadlock_with_the_bubble_and_memory_of_the_text",
            "test_schedule_of_any_shape_is_the_texts"],
        "each stage runs each micro-batch's forward and backward exactly once": [
            "test_schedule_runs_without_deadlock_with_the_bubble_and_memory_of_the_text",
            "test_schedule_of_any_shape_is_the_texts"],
        "an unknown kind raises ValueError": ["test_schedule_rejects_what_is_not_a_pipeline"],
        "fewer than 1 stage raises ValueError": ["test_schedule_rejects_what_is_not_a_pipeline"],
        "fewer than 1 micro-batch raises ValueError": [
            "test_schedule_rejects_what_is_not_a_pipeline"],
    },
}


# (stages, micro-batches): fewer micro-batches than a warm-up wants, too
SHAPES = [(1, 1), (2, 1), (2, 4), (3, 5), (4, 1), (4, 2), (4, 4), (4, 8)]


@pytest.mark.task7_1
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro_batches", SHAPES, ids=[f"p{p}-m{m}" for p, m in SHAPES])
def test_schedule_runs_without_deadlock_with_the_bubble_and_memory_of_the_text(
        ex, kind, stages, micro_batches):
    """GPipe and 1F1B run in the lesson's simulator (a backward twice a forward, each send posted
    with the next receive) without deadlock, each stage receiving in its neighbour's order, idle
    (p - 1) / (m + p - 1) of the time and holding m (GPipe) or min(p - s, m) (1F1B) micro-batches'
    activations: 8 shapes, p <= 4, m <= 8."""
    assert_schedule_of_the_text(ex, kind, stages, micro_batches)


@pytest.mark.task7_1
@sweep(kind=st.sampled_from(["gpipe", "1f1b"]), stages=st.integers(1, 8),
       micro_batches=st.integers(1, 16), max_examples=60)
def test_schedule_of_any_shape_is_the_texts(ex, kind, stages, micro_batches):
    """GPipe and 1F1B of 60 generated shapes (p <= 8, m <= 16) pass the same simulator checks and
    are, action by action, the text's order (the simulator's reference schedules).

    The docstring of schedule says which action comes when."""
    plan = assert_schedule_of_the_text(ex, kind, stages, micro_batches)
    expected = reference_schedule(kind, stages, micro_batches)
    for stage, (got, want) in enumerate(zip(plan, expected, strict=True)):
        assert [tuple(a) for a in got] == want, (
            f"schedule({kind!r}, {stages}, {micro_batches}): stage {stage} runs {got}, the text's "
            f"{kind} runs {want}")


def assert_schedule_of_the_text(ex, kind: str, stages: int, micro_batches: int) -> list:
    __tracebackhide__ = True
    plan = ex.schedule(kind, stages, micro_batches)
    call = f"schedule({kind!r}, {stages}, {micro_batches})"
    assert isinstance(plan, list) and len(plan) == stages, (
        f"{call} returned {type(plan).__name__} of length {len(plan)}; expected a list with one "
        f"list of actions per stage")
    try:
        timeline = simulate([list(map(tuple, actions)) for actions in plan], micro_batches)
    except Deadlock as error:
        raise AssertionError(f"{call} deadlocks: {error}") from None
    except OrderMismatch as error:
        raise AssertionError(f"{call} would hand stages the wrong micro-batches: {error}") from None
    except ScheduleError as error:
        raise AssertionError(f"{call} is not a schedule: {error}") from None
    bubble = (stages - 1) / (micro_batches + stages - 1)
    assert timeline.bubble_fraction() == pytest.approx(bubble), (
        f"{call}: the stages are idle {timeline.bubble_fraction():.1%} of the time, expected "
        f"(p - 1) / (m + p - 1) = {bubble:.1%}: a stage waits longer than it must"
        + ("; 1F1B's stage s warms up with p - s - 1 forwards" if kind == "1f1b" else ""))
    for stage in range(stages):
        held = timeline.peak_in_flight(stage)
        expected = micro_batches if kind == "gpipe" else min(stages - stage, micro_batches)
        assert held == expected, (
            f"{call}: stage {stage} holds the activations of up to {held} micro-batches at "
            f"once, expected {expected}: "
            + ("GPipe runs every forward before any backward" if kind == "gpipe" else
               "1F1B's stage s holds at most p - s (after min(p - s - 1, m) warm-up forwards, "
               "one forward then one backward)"))
    return plan


@pytest.mark.task7_1
@pytest.mark.parametrize("arguments", [("zero-bubble", 2, 4), ("1f1b", 0, 4), ("gpipe", 2, 0)],
                         ids=["unknown-kind", "no-stages", "no-micro-batches"])
def test_schedule_rejects_what_is_not_a_pipeline(ex, arguments):
    """schedule raises ValueError for an unknown kind ("zero-bubble"), 0 stages and 0
    micro-batches."""
    try:
        got = ex.schedule(*arguments)
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the wrong kind of error is the finding
        raise AssertionError(f"schedule{arguments} raised {type(error).__name__}: {error}; "
                             f"raise ValueError") from None
    raise AssertionError(f"schedule{arguments} returned {got!r:.80}: raise ValueError")


