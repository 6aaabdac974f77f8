"""Fixtures the test files of lesson 07 share: the graded module, and the script's torchrun run,
started before the lesson's first test so that its seconds of importing torch overlap the
other checks."""

import pytest

from harness.exercises import load_exercise
from harness.launch import start_first, start_script
from lesson07.common import BALANCE, LESSON, SCRIPT, TRAIN

start_launches_first = start_first("script_run", __file__)  # while the other checks run
start_balance_first = start_first("balance_run", __file__)


@pytest.fixture
def ex():
    return load_exercise(LESSON)


@pytest.fixture(scope="session")
def script_run():
    """train_pp.py on 2 ranks, 4 micro-batches (test_07_pipeline_parallel.py holds it to lesson
    03's script on one process)."""
    run = start_script(SCRIPT, *TRAIN, "--micro-batches", "4", launcher="torchrun", nproc=2)
    yield run
    run.stop()


@pytest.fixture(scope="session")
def balance_run():
    """balance_stages.py on 2 ranks at a small size (test_07_pipeline_parallel.py checks its
    cuts and predictions against its own measured layer times)."""
    run = start_script(f"lessons/{LESSON}/balance_stages.py", *BALANCE, launcher="torchrun",
                       nproc=2)
    yield run
    run.stop()
