"""Lesson 02's fixtures that more than one of its test files uses: ``ex`` (the graded exercises:
yours, or the reference answers with --solutions), ``no_tf32``, and ``script_runs``, the lesson's
two scripts started in the background before the lesson's first test."""

from __future__ import annotations

import pytest

from harness.compare import full_fp32
from harness.exercises import LESSONS_DIR, load_exercise
from harness.launch import QUICK_SAMPLE, start_first, start_script
from lesson02.common import LESSON


@pytest.fixture(scope="module")
def ex():
    return load_exercise(LESSON)


@pytest.fixture
def no_tf32():
    """Full fp32 matmuls while GPU results are compared with CPU ones (TF32 would round)."""
    with full_fp32():
        yield


# Both scripts are started together, once, when the first of their tests asks: each spends
# most of its time importing torch, and two cores do that for both at once.
SCRIPT_RUNS = {
    # An epoch over the first 480 windows: 30 steps, enough for the loss to fall clearly.
    "train.py": ["--epochs", "1", "--train-windows", "480", "--micro-batches", "2",
                 *QUICK_SAMPLE],
    "pipeline_sweep.py": ["--width", "16", "--blocks", "4", "--batch-size", "30",
                          "--micro-batches", "1,2,4,64", "--steps", "2"],
}


@pytest.fixture(scope="session")
def script_runs():
    runs = {name: start_script(LESSONS_DIR / LESSON / name, *args)
            for name, args in SCRIPT_RUNS.items()}
    yield runs
    for launched in runs.values():
        launched.stop()


start_launches_first = start_first("script_runs", __file__)  # while the other checks run
