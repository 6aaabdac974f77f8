"""Fixtures the test files of lesson 07 share: the graded module, and the script's torchrun run,
started before the lesson's first test so that its seconds of importing torch overlap the
other checks."""

import pytest

from harness.exercises import load_exercise
from harness.launch import start_first, start_script
from lesson07.common import LESSON, SCRIPT, TRAIN

start_launches_first = start_first("script_run", __file__)  # while the other checks run


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
