"""task7_5, interleaved 1F1B: each rank's forwards and backwards over its v chunks, held to the
order torch's ScheduleInterleaved1F1B builds (read from its pipeline_order on a fake process
group) for every shape generated, and run through the lesson's simulator.

    pytest lessons/07_pipeline_parallel -m task7_5
"""

from __future__ import annotations

import functools

import pytest

from harness.exercises import raise_if_untouched
from harness.ranks import in_a_child
from harness.sweep import st, sweep
from lesson07.common import torch_orders as torch_built
from lesson07.simulator import Deadlock, ScheduleError, simulate

# The task's contract, clause by clause, and the tests that fail when only that clause is
# broken (tests/test_course.py checks the names).
CLAUSES = {
    "task7_5": {
        "result[r] is rank r's list of actions, ('F', i, c) or ('B', i, c), in order": [
            "test_interleaved_is_torchs_order", "test_interleaved_of_any_shape_is_torchs"],
        "rank r's chunk c is stage c * p + r (a micro-batch passes every rank per chunk)": [
            "test_interleaved_runs_in_the_simulator_with_the_bubble_of_the_text"],
        "the micro-batches go in max(1, m // p) rounds of n = m / rounds": [
            "test_interleaved_is_torchs_order", "test_interleaved_of_any_shape_is_torchs"],
        "an m that is not a multiple of the number of rounds raises ValueError": [
            "test_interleaved_of_any_shape_is_torchs", "test_interleaved_rejects_what_is_not_one"],
        "rank r's i-th forward runs chunk (i // n) % v": [
            "test_interleaved_is_torchs_order", "test_interleaved_of_any_shape_is_torchs"],
        "its j-th backward runs chunk v - 1 - (j // n) % v": [
            "test_interleaved_is_torchs_order", "test_interleaved_of_any_shape_is_torchs"],
        "each runs the oldest micro-batch its chunk has not run": [
            "test_interleaved_is_torchs_order", "test_interleaved_of_any_shape_is_torchs"],
        "rank r warms up with min((v - 1) * n + 2 * (p - 1 - r), v * m) forwards": [
            "test_interleaved_is_torchs_order", "test_interleaved_of_any_shape_is_torchs"],
        "then one forward and one backward until the forwards are done": [
            "test_interleaved_is_torchs_order", "test_interleaved_of_any_shape_is_torchs"],
        "then the remaining backwards": [
            "test_interleaved_is_torchs_order", "test_interleaved_of_any_shape_is_torchs"],
        "fewer than 1 rank, 1 chunk or 1 micro-batch raise ValueError": [
            "test_interleaved_rejects_what_is_not_one"],
    },
}

# The sweep's bounds: torch's order for every shape within them is read once, in a child.
MAX_RANKS, MAX_CHUNKS, MAX_MICRO_BATCHES = 6, 4, 16


@functools.cache
def torch_orders() -> dict:
    """Read once, when a test first needs it (an untouched stub never does)."""
    return in_a_child(torch_built, "interleaved", MAX_RANKS, MAX_CHUNKS, MAX_MICRO_BATCHES,
                      timeout=120)


# (ranks, chunks, micro-batches): the text's picture; m < p; m not a multiple of p, in rounds
# (10 = 2 rounds of 5); one rank; one chunk (not 1F1B: its warm-up is twice as long)
SHAPES = [(4, 2, 8), (2, 2, 4), (4, 2, 3), (4, 2, 10), (3, 3, 6), (1, 3, 2), (4, 1, 4)]


@pytest.mark.task7_5
@pytest.mark.parametrize("ranks,chunks,micro_batches", SHAPES,
                         ids=[f"p{p}-v{v}-m{m}" for p, v, m in SHAPES])
def test_interleaved_is_torchs_order(ex, ranks, chunks, micro_batches):
    """interleaved(p, v, m) is torch's order: each rank's list against the pipeline_order of
    ScheduleInterleaved1F1B, built on a fake process group, on 7 shapes (among them m < p, m in 2
    rounds, one rank, one chunk)."""
    raise_if_untouched(ex.interleaved)
    assert_torchs_order(ex, ranks, chunks, micro_batches)


@pytest.mark.task7_5
@sweep(ranks=st.integers(1, MAX_RANKS), chunks=st.integers(1, MAX_CHUNKS),
       micro_batches=st.integers(1, MAX_MICRO_BATCHES), max_examples=80)
def test_interleaved_of_any_shape_is_torchs(ex, ranks, chunks, micro_batches):
    """interleaved is torch's order on 80 generated shapes (p <= 6, v <= 4, m <= 16), and raises
    ValueError wherever torch refuses the shape."""
    raise_if_untouched(ex.interleaved)
    assert_torchs_order(ex, ranks, chunks, micro_batches)


@pytest.mark.task7_5
@pytest.mark.parametrize("ranks,chunks,micro_batches", [(4, 2, 8), (2, 3, 4), (3, 2, 5), (4, 4, 4)],
                         ids=["p4-v2-m8", "p2-v3-m4", "p3-v2-m5", "p4-v4-m4"])
def test_interleaved_runs_in_the_simulator_with_the_bubble_of_the_text(ex, ranks, chunks,
                                                                        micro_batches):
    """Interleaved 1F1B runs in the simulator, rank r's chunk c being stage c * p + r, without
    deadlock, each chunk's link passing the micro-batches in one order, idle (p - 1) / (v
    m + p - 1) of the time: 4 shapes with m >= p, v from 2 to 4.

    That is v times less idle time than 1F1B's."""
    raise_if_untouched(ex.interleaved)
    plan = ex.interleaved(ranks, chunks, micro_batches)
    call = f"interleaved({ranks}, {chunks}, {micro_batches})"
    assert_shape(plan, call, ranks)
    try:
        timeline = simulate([list(map(tuple, actions)) for actions in plan], micro_batches,
                            posting=None)
    except Deadlock as error:
        raise AssertionError(f"{call} deadlocks, with rank r's chunk c as stage c * p + r: "
                             f"{error}") from None
    except ScheduleError as error:
        raise AssertionError(f"{call} is not a schedule: {error}") from None
    bubble = (ranks - 1) / (chunks * micro_batches + ranks - 1)
    assert timeline.bubble_fraction() == pytest.approx(bubble), (
        f"{call}: the ranks are idle {timeline.bubble_fraction():.1%} of the time, expected "
        f"(p - 1) / (v m + p - 1) = {bubble:.1%}")


@pytest.mark.task7_5
@pytest.mark.parametrize("arguments", [(4, 2, 9), (3, 2, 7), (0, 2, 4), (2, 0, 4), (2, 2, 0),
                                       (-1, 2, 4), (2, -1, 4), (2, 2, -3)],
                         ids=["m9-in-2-rounds", "m7-in-2-rounds", "no-ranks", "no-chunks",
                              "no-micro-batches", "negative-ranks", "negative-chunks",
                              "negative-micro-batches"])
def test_interleaved_rejects_what_is_not_one(ex, arguments):
    """interleaved raises ValueError for m not a multiple of its rounds (9 or 7 micro-batches in 2
    rounds) and for ranks, chunks or micro-batches below 1."""
    raise_if_untouched(ex.interleaved)
    try:
        got = ex.interleaved(*arguments)
    except ValueError:
        return
    except Exception as error:  # noqa: BLE001 - the wrong kind of error is the finding
        raise AssertionError(f"interleaved{arguments} raised {type(error).__name__}: {error}; "
                             f"raise ValueError") from None
    p, _, m = arguments
    why = (f": {m} micro-batches go in max(1, m // p) = {max(1, m // p)} rounds, and {m} is "
           f"not a multiple of that" if p > 0 and m > 0 and arguments[1] > 0
           else ": every count must be at least 1")
    raise AssertionError(f"interleaved{arguments} returned {got!r:.80}: raise ValueError{why}")


def assert_shape(plan, call: str, ranks: int) -> None:
    __tracebackhide__ = True
    assert isinstance(plan, list) and len(plan) == ranks, (
        f"{call} returned {type(plan).__name__} of length "
        f"{len(plan) if hasattr(plan, '__len__') else '?'}; expected a list with one list of "
        f"actions per rank")
    for rank, actions in enumerate(plan):
        for action in actions:
            assert isinstance(action, (tuple, list)) and len(action) == 3, (
                f"{call}: rank {rank} has the action {action!r}; each is ('F', i, c) or "
                f"('B', i, c), naming the micro-batch i and the chunk c")


def assert_torchs_order(ex, ranks: int, chunks: int, micro_batches: int) -> None:
    __tracebackhide__ = True
    call = f"interleaved({ranks}, {chunks}, {micro_batches})"
    want = torch_orders()[ranks, chunks, micro_batches]
    rounds = max(1, micro_batches // ranks)
    if want is None:
        try:
            got = ex.interleaved(ranks, chunks, micro_batches)
        except ValueError:
            return
        raise AssertionError(
            f"{call} returned a schedule, but {micro_batches} micro-batches do not go in "
            f"max(1, m // p) = {rounds} equal rounds (torch refuses it too): raise ValueError")
    try:
        got = ex.interleaved(ranks, chunks, micro_batches)
    except ValueError as error:
        raise AssertionError(f"{call} raised ValueError ({error}), but torch builds it: "
                             f"{micro_batches} micro-batches go in {rounds} round(s) of "
                             f"{micro_batches // rounds}") from None
    except ZeroDivisionError as error:
        raise AssertionError(f"{call} divided by zero ({error}): with fewer micro-batches than "
                             f"ranks there is one round, max(1, m // p)") from None
    assert_shape(got, call, ranks)
    for rank in range(ranks):
        mine = [tuple(action) for action in got[rank]]
        if mine != want[rank]:
            raise AssertionError(f"{call}: rank {rank} runs {_show(mine)}; torch's "
                                 f"ScheduleInterleaved1F1B runs {_show(want[rank])}. "
                                 + diagnose(mine, want[rank], ranks, chunks, micro_batches,
                                            rank))


def diagnose(got: list, want: list, ranks: int, chunks: int, micro_batches: int,
             rank: int) -> str:
    """Which rule of the docstring the rank's actions break first."""
    n = micro_batches // max(1, micro_batches // ranks)
    warmup = min((chunks - 1) * n + 2 * (ranks - 1 - rank), chunks * micro_batches)
    def leading(actions: list) -> int:
        return next((i for i, a in enumerate(actions) if a[0] != "F"), len(actions))

    if leading(got) != leading(want):
        return (f"It runs {leading(got)} forwards before its first backward, torch "
                f"{leading(want)}: the warm-up is min((v - 1) * n + 2 * (p - 1 - r), v * m) = "
                f"min({chunks - 1} * {n} + 2 * {ranks - 1 - rank}, {chunks * micro_batches}) = "
                f"{warmup} forwards, n = {n} micro-batches per round, and one more forward "
                f"comes before the first backward")
    for kind, rule in (("F", f"(i // n) % v, n = {n}"), ("B", f"v - 1 - (j // n) % v, n = {n}")):
        mine = [c for k, _, c in got if k == kind]
        theirs = [c for k, _, c in want if k == kind]
        if mine != theirs:
            which = "forward" if kind == "F" else "backward"
            at = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
                      min(len(mine), len(theirs)))
            return (f"Its {which}s run the chunks {mine[:16]}{' ...' if len(mine) > 16 else ''}"
                    f"; its {which} {at} (counting from 0) runs chunk "
                    f"{theirs[at] if at < len(theirs) else '-'} in torch's: "
                    f"the rule is chunk {rule}, so a rank stays on a chunk for a round of n "
                    f"micro-batches")
    for kind in "FB":
        for chunk in range(chunks):
            mine = [i for k, i, c in got if k == kind and c == chunk]
            if mine != list(range(micro_batches)):
                return (f"Its {'forwards' if kind == 'F' else 'backwards'} of chunk {chunk} run "
                        f"the micro-batches {mine[:16]}: each runs the oldest micro-batch its "
                        f"chunk has not run, 0, 1, ..., {micro_batches - 1}")
    return ("After the warm-up it alternates one forward and one backward until the forwards "
            "are done, then runs the remaining backwards")


def _show(actions: list) -> str:
    text = ", ".join(f"{k}{i}.{c}" for k, i, c in actions[:14])
    return f"[{text}{', ...' if len(actions) > 14 else ''}] (F2.1: micro-batch 2, chunk 1)"
