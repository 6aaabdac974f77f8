"""Grades task2_3, bubble_fraction: the idle share of a GPipe step, against a step-by-step
simulation of its schedule (simulate_gpipe, in common.py).

    pytest lessons/02_model_parallel -m task2_3
"""

from __future__ import annotations

import math

import pytest

from lesson02.common import assert_refused, simulate_gpipe

# This task's contract, clause by clause, and the tests that fail when only that clause
# is broken (tests/test_course.py checks the names).
CLAUSES = {
    "task2_3": {
        "the idle share of the whole GPipe step, as a Python float": [
            "test_bubble_fraction_matches_a_simulated_gpipe_schedule"],
        "0 for one stage, (p - 1) / p for one micro-batch": [
            "test_bubble_fraction_matches_a_simulated_gpipe_schedule"],
        "num_stages or num_micro_batches below 1 is a ValueError": [
            "test_bubble_fraction_refuses_empty_schedules"],
    },
}


@pytest.mark.task2_3
@pytest.mark.parametrize("num_stages", range(1, 9))
def test_bubble_fraction_matches_a_simulated_gpipe_schedule(ex, num_stages):
    """bubble_fraction returns a float equal (to 1e-9, relative) to the idle share of GPipe's
    schedule simulated slot by slot (simulate_gpipe in common.py), for 1 to 8 stages and 1 to 16
    micro-batches."""
    for m in range(1, 17):
        got = ex.bubble_fraction(num_stages, m)
        expected, _ = simulate_gpipe(num_stages, m)
        assert isinstance(got, float), (
            f"bubble_fraction({num_stages}, {m}) returned a {type(got).__name__}, expected a "
            "Python float"
        )
        slots = 2 * num_stages * (m + num_stages - 1)
        assert math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12), (
            f"bubble_fraction(num_stages={num_stages}, num_micro_batches={m}) = {got:.6g}; the "
            f"simulated schedule is idle {expected:.6g} of the time ({round(expected * slots)} "
            f"of {slots} stage-steps). Count the forward phase: how many steps does it take, "
            "and for how many of them is each stage busy?"
        )


@pytest.mark.task2_3
@pytest.mark.parametrize(("num_stages", "m"), [(0, 4), (4, 0), (-1, 2), (2, -3)])
def test_bubble_fraction_refuses_empty_schedules(ex, num_stages, m):
    """bubble_fraction refuses stage or micro-batch counts below 1 with a ValueError: (0, 4), (4,
    0), (-1, 2) and (2, -3)."""
    assert_refused(lambda: ex.bubble_fraction(num_stages, m),
                   f"bubble_fraction({num_stages}, {m})", "a schedule needs p >= 1 and m >= 1")
