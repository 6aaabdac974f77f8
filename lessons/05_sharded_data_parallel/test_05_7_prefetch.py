"""Grades task5_7, prefetch: which all-gathers FSDP2 has started when each block's forward and
backward begin, read off a step's timeline (lesson05.common.Timeline) of a tower whose blocks
all differ in size, against what the docstring asks, for generated depths and distances; and
the gradients against the same step without prefetching.

    pytest lessons/05_sharded_data_parallel -m task5_7
"""

from __future__ import annotations

import pytest
import torch

from harness.exercises import load_exercise
from harness.ranks import run_on_ranks
from harness.sweep import st, sweep
from lesson05.common import LESSON, Tower, tower_step

# This task's contract, clause by clause, and the tests that fail when only that clause
# is broken (tests/test_course.py checks the names).
CLAUSES = {
    "task5_7": {
        "block i's forward starts the all-gathers of blocks i + 1 to i + forward": [
            "test_prefetching_starts_what_it_is_asked_to",
            "test_prefetching_for_any_depth_and_distances"],
        "near the end, as many as are left": [
            "test_prefetching_starts_what_it_is_asked_to",
            "test_prefetching_for_any_depth_and_distances"],
        "block i's backward starts those of blocks i - 1 to i - backward, nearest first": [
            "test_prefetching_starts_what_it_is_asked_to",
            "test_prefetching_for_any_depth_and_distances"],
        "forward=0 starts none ahead": ["test_prefetching_starts_what_it_is_asked_to",
                                        "test_prefetching_for_any_depth_and_distances"],
        "backward=0 leaves the backward to FSDP's default, one block ahead":
            ["test_prefetching_starts_what_it_is_asked_to",
             "test_prefetching_for_any_depth_and_distances"],
        "forward < 0 or backward < 0 raises ValueError":
            ["test_prefetch_refuses_negative_distances"],
        "forward=1, backward=1 by default": ["test_prefetching_starts_what_it_is_asked_to"],
        "each block gathered once per pass, the gradients unchanged": [
            "test_prefetching_starts_what_it_is_asked_to",
            "test_prefetching_for_any_depth_and_distances"],
    },
}


def steps_on_rank(ctx, depth: int, forward: int | None, backward: int | None) -> dict:
    """The tower's step with the learner's prefetch (None: its default), and without any."""
    ex = load_exercise(LESSON)
    given = {name: value for name, value in (("forward", forward), ("backward", backward))
             if value is not None}
    return {"mine": tower_step(ctx, depth, lambda blocks: ex.prefetch(blocks, **given)),
            "plain": tower_step(ctx, depth)}


def gathered(events: list[str]) -> list[int]:
    return [int(event[2:]) for event in events if event.startswith("AG")]


def check_schedule(depth: int, forward: int | None, backward: int | None) -> None:
    """``forward``/``backward`` None: left to prefetch's defaults, 1 each."""
    call = (f"prefetch(a tower's {depth} blocks"
            + "".join(f", {name}={value}" for name, value in (("forward", forward),
                                                               ("backward", backward))
                      if value is not None) + ")")
    runs = run_on_ranks(steps_on_rank, depth, forward, backward, world_size=2)
    forward, backward = 1 if forward is None else forward, 1 if backward is None else backward
    for rank, got in enumerate(runs):
        events = got["mine"]["events"]
        timeline = f"the step was: {' '.join(events)}"
        split = events.index(f"F{depth - 1}") + 1
        ahead, behind = events[:split], events[split:]
        assert gathered(ahead) == list(range(depth)), (
            f"rank {rank}, {call}: the forward's all-gathers were of blocks {gathered(ahead)}; "
            f"expected each block once, in the forward's order {list(range(depth))}: a block's "
            f"forward list runs nearest first, and never names a block twice ({timeline})")
        for i in range(depth):
            before = gathered(ahead[:ahead.index(f"F{i}")])
            want = list(range(min(i + forward, depth - 1) + 1))
            assert before == want, (
                f"rank {rank}, {call}: when block {i}'s forward began, blocks {before} had "
                f"been all-gathered; expected {want}: blocks 0 to {i} and the {forward} "
                f"after {i} (as many as are left), each started at the forward of the "
                f"block {forward} before it ({timeline})")
        assert gathered(behind) == list(range(depth - 1, -1, -1)), (
            f"rank {rank}, {call}: the backward's all-gathers were of blocks "
            f"{gathered(behind)}; expected each block once, nearest first "
            f"{list(range(depth - 1, -1, -1))}: block i's backward list is i - 1, i - 2, ..., "
            f"and names none whose backward has run ({timeline})")
        for i in range(depth):
            before = gathered(behind[:behind.index(f"B{i}")])
            want = list(range(depth - 1, max(0, i - max(backward, 1)) - 1, -1))
            assert before == want, (
                f"rank {rank}, {call}: when block {i}'s backward began, the backward had "
                f"all-gathered blocks {before}; expected {want}: blocks {depth - 1} to {i} and "
                f"the {max(backward, 1)} before it (backward={backward}"
                f"{', which leaves FSDP its default of 1' if backward == 0 else ''}) ({timeline})")
        scattered = sorted(int(event[2:]) for event in events if event.startswith("RS"))
        assert scattered == list(range(depth)), (rank, call, timeline)
        for name, (mine, plain) in enumerate(zip(got["mine"]["grads"], got["plain"]["grads"],
                                                 strict=True)):
            assert torch.equal(mine, plain), (
                f"rank {rank}, {call}: gradient {name} differs from the step without "
                f"prefetching by {(mine - plain).abs().max().item():.3g}")


@pytest.mark.task5_7
@pytest.mark.parametrize(("depth", "forward", "backward"),
                         [(4, 1, 2), (4, None, None), (4, 0, 0), (3, 0, 1), (4, 2, 0),
                          (3, 3, 3)],
                         ids=["text", "defaults", "none-ahead", "forward-0", "backward-0",
                              "past-the-ends"])
def test_prefetching_starts_what_it_is_asked_to(ex, depth, forward, backward):
    """On 2 gloo ranks, in 6 fixed cases (the text's, the defaults, zeros, distances past the
    ends), each block's forward and backward begin with exactly the all-gathers the distances
    call for issued, each block gathered once per pass, and the gradients those of the step
    without prefetching.

    Backward 0 leaves FSDP's default, one block ahead. The timeline is that of a tower of blocks
    of different sizes, each collective told apart by its size (lesson05.common.Timeline)."""
    ex.prefetch([])  # "not attempted" here, not on the ranks
    check_schedule(depth, forward, backward)


@pytest.mark.task5_7
@sweep(max_examples=15, depth=st.integers(1, 5), forward=st.integers(0, 6),
       backward=st.integers(0, 6))
def test_prefetching_for_any_depth_and_distances(ex, depth, forward, backward):
    """For generated towers of 1 to 5 blocks and distances of 0 to 6, each block's forward and
    backward begin with exactly the all-gathers asked for issued, and the gradients equal the
    step without prefetching (2 gloo ranks)."""
    ex.prefetch([], forward, backward)
    check_schedule(depth, forward, backward)


@pytest.mark.task5_7
@pytest.mark.parametrize(("forward", "backward"), [(-1, 1), (1, -1)])
def test_prefetch_refuses_negative_distances(ex, forward, backward):
    """A negative forward or backward distance raises ValueError, checked before the blocks are
    touched."""
    call = f"prefetch(blocks, forward={forward}, backward={backward})"
    try:
        ex.prefetch(list(Tower(2).blocks), forward, backward)  # not sharded: check first
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the wrong kind of error is the finding
        raise AssertionError(f"{call} raised {type(error).__name__}: {error}; check the "
                             f"distances first and raise ValueError") from None
    raise AssertionError(f"{call} returned: raise ValueError for a negative number of blocks")
