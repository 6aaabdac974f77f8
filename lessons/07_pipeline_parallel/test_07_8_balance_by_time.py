"""task7_8, balancing the stages by time: balance_by_time's cut against every cut of generated
layer times (ties included), and the pipeline's step in the simulator, paced by the slowest
stage.

    pytest lessons/07_pipeline_parallel -m task7_8
"""

from __future__ import annotations

import re

import pytest

from harness.exercises import raise_if_untouched
from harness.sweep import st, sweep
from lesson07.common import every_cut, stage_times
from lesson07.simulator import reference_schedule, simulate

# The task's contract, clause by clause, and the tests that fail when only that clause is
# broken (tests/test_course.py checks the names).
CLAUSES = {
    "task7_8": {
        "one count per stage, each at least 1, summing to len(seconds)": [
            "test_balance_by_time_is_the_cut_whose_slowest_stage_is_fastest"],
        "a stage's time is the sum of its consecutive layers'": [
            "test_balance_by_time_is_the_cut_whose_slowest_stage_is_fastest",
            "test_the_balanced_cut_gives_gpipe_its_shortest_step"],
        "the cut whose slowest stage is fastest": [
            "test_balance_by_time_is_the_cut_whose_slowest_stage_is_fastest",
            "test_the_balanced_cut_gives_gpipe_its_shortest_step"],
        "ties: the fewest layers in the first stage, then the second, ...": [
            "test_balance_by_time_breaks_ties_with_the_fewest_layers_first"],
        "more stages than layers raise ValueError": [
            "test_balance_by_time_refuses_what_cannot_be_cut"],
        "fewer than 1 stage raise ValueError": ["test_balance_by_time_refuses_what_cannot_be_cut"],
    },
}


# Halves, so that every sum is exact and ties are real ties.
TIMES = st.lists(st.integers(1, 16).map(lambda k: k / 2), min_size=1, max_size=9)


@pytest.mark.task7_8
@sweep(seconds=TIMES, data=st.data(), max_examples=80)
def test_balance_by_time_is_the_cut_whose_slowest_stage_is_fastest(ex, seconds, data):
    """balance_by_time returns one count per stage, each at least 1, summing to the layers, and its
    slowest stage is as fast as the best of every cut: 80 generated lists of 1 to 9 layer times (in
    halves, so that sums are exact), into 1 to that many stages."""
    raise_if_untouched(ex.balance_by_time)
    stages = data.draw(st.integers(1, len(seconds)), label="stages")
    call = f"balance_by_time({seconds}, {stages})"
    got = ex.balance_by_time(list(seconds), stages)
    assert isinstance(got, list) and len(got) == stages, (
        f"{call} returned {got!r}: one count of layers per stage, {stages} of them")
    assert all(isinstance(c, int) and c >= 1 for c in got) and sum(got) == len(seconds), (
        f"{call} returned {got}: every stage gets at least one layer and the counts add up "
        f"to the {len(seconds)} layers")
    slowest = max(stage_times(seconds, got))
    best, best_counts = min(every_cut(seconds, stages), key=lambda cut: cut[0])
    assert slowest == best, (
        f"{call}: stages of {got} layers take {stage_times(seconds, got)}, the slowest "
        f"{slowest}; the cut {best_counts} takes {stage_times(seconds, best_counts)}, the "
        f"slowest {best}. Weigh the layers' times and try every cut (or search for the "
        f"smallest slowest stage): neither equal numbers of layers nor a greedy fill up to the "
        f"average finds it")


@pytest.mark.task7_8
@sweep(seconds=TIMES, data=st.data(), max_examples=80)
def test_balance_by_time_breaks_ties_with_the_fewest_layers_first(ex, seconds, data):
    """Of the cuts whose slowest stage is fastest, balance_by_time takes the first in
    itertools.combinations order (the fewest layers in the first stage, then the second, ...): 80
    generated lists of times in halves, which tie often, against every cut."""
    raise_if_untouched(ex.balance_by_time)
    stages = data.draw(st.integers(1, len(seconds)), label="stages")
    got = ex.balance_by_time(list(seconds), stages)
    best = min(time for time, _ in every_cut(seconds, stages))
    if len(got) != stages or sum(got) != len(seconds) or max(stage_times(seconds, got)) != best:
        return  # not a fastest cut: the test above says so
    first = next(counts for time, counts in every_cut(seconds, stages) if time == best)
    assert got == first, (
        f"balance_by_time({seconds}, {stages}): {got} and {first} both have a slowest stage of "
        f"{best}; the tie goes to the fewest layers in the first stage, then the second, ...: "
        f"{first}")


# (layer times, stages): a first layer with the embeddings that costs little, a head that
# costs much; uneven blocks; one stage; as many stages as layers
CASES = [([0.6, 1.0, 1.0, 1.0, 1.0, 1.8], 3), ([3.0, 1.0, 1.0, 1.0, 2.0, 2.0], 2),
         ([1.0, 2.0, 3.0], 1), ([2.0, 1.0, 4.0], 3)]


@pytest.mark.task7_8
@pytest.mark.parametrize("seconds,stages", CASES, ids=["head-heavy", "uneven", "one", "each"])
def test_the_balanced_cut_gives_gpipe_its_shortest_step(ex, seconds, stages):
    """balance_by_time's cut gives GPipe its shortest step: in the simulator, 8 micro-batches, each
    stage taking its layers' time per micro-batch, against the step of every cut, on 4 cases (a
    head-heavy model, uneven layers, one stage, a stage per layer).

    The step is the stages' total plus (m - 1) times the slowest stage."""
    raise_if_untouched(ex.balance_by_time)
    m = 8

    def step(counts: list[int]) -> float:
        timeline = simulate(reference_schedule("gpipe", stages, m), m, forward_time=1 / 3,
                            backward_time=2 / 3, posting=None,
                            stage_cost=stage_times(seconds, counts))
        return timeline.makespan

    got = ex.balance_by_time(list(seconds), stages)
    shortest = min(step(counts) for _, counts in every_cut(seconds, stages))
    assert step(got) == pytest.approx(shortest), (
        f"balance_by_time({seconds}, {stages}) = {got}: GPipe with 8 micro-batches takes "
        f"{step(got):.2f} s a step on those stages, {shortest:.2f} on the best cut")


@pytest.mark.task7_8
@pytest.mark.parametrize("seconds,stages", [([1.5] * 5, 7), ([1.5] * 3, 0), ([1.5] * 6, -2)],
                         ids=["more-stages-than-layers", "no-stages", "negative-stages"])
def test_balance_by_time_refuses_what_cannot_be_cut(ex, seconds, stages):
    """balance_by_time raises ValueError naming both numbers for more stages than layers (7 for 5),
    0 stages and -2 stages."""
    raise_if_untouched(ex.balance_by_time)
    try:
        got = ex.balance_by_time(seconds, stages)
    except ValueError as error:
        numbers = re.findall(r"-?\d+(?:\.\d+)?", str(error))
        assert str(len(seconds)) in numbers and str(stages) in numbers, (
            f"balance_by_time({seconds}, {stages}) raised ValueError({error!r}); name both "
            f"numbers, {len(seconds)} layers and {stages} stages")
        return
    except Exception as error:  # noqa: BLE001 - the wrong kind of error is the finding
        raise AssertionError(f"balance_by_time({seconds}, {stages}) raised "
                             f"{type(error).__name__}: {error}; raise ValueError") from None
    raise AssertionError(f"balance_by_time({seconds}, {stages}) returned {got!r}: raise "
                         f"ValueError, {len(seconds)} layers cannot make {stages} stages")
