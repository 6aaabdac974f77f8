"""Lesson 11's fixtures, shared by its test files: ``ex`` (the graded exercises), and
``script_run``, the torchrun run of moe.py that test_11_mixture_of_experts.py reads, started
in the background before the lesson's first test when a selected test uses it."""

from __future__ import annotations

import pytest

from harness.exercises import load_exercise
from harness.launch import start_first, start_script
from lesson11.common import LESSON, SCRIPT


@pytest.fixture
def ex():
    return load_exercise(LESSON)


start_launch_first = start_first("script_run", __file__)  # while the other checks run


@pytest.fixture(scope="session")
def script_run():
    run = start_script(SCRIPT, "--tokens", "32", "--width", "16", launcher="torchrun", nproc=2)
    yield run
    run.stop()
