"""Lesson 10's fixtures, shared by its test files: ``ex`` (the graded exercises) and
``script_run``, the torchrun run of ring_attention.py that test_10_long_sequences.py reads,
started in the background before the lesson's first test when a selected test uses it."""

from __future__ import annotations

import pytest

from harness.exercises import load_exercise
from harness.launch import start_first, start_script
from lesson10.common import LESSON, SCRIPT, SCRIPT_ARGS


@pytest.fixture
def ex():
    return load_exercise(LESSON)


start_launches_first = start_first("script_run", __file__)  # while the other checks run


@pytest.fixture(scope="session")
def script_run():
    run = start_script(SCRIPT, *SCRIPT_ARGS, launcher="torchrun", nproc=4)
    yield run
    run.stop()
