"""Lesson 06's fixtures, shared by its test files: ``ex`` (the graded exercises) and
``script_run``, the torchrun run of train_tp.py that test_06_tensor_parallel.py's script check
reads, started in the background before the lesson's first test (in whichever file) when a
selected test uses it."""

from __future__ import annotations

import pytest

from harness.exercises import load_exercise
from harness.launch import start_first, start_script
from lesson06.common import LESSON, SCRIPT, TRAIN


@pytest.fixture
def ex():
    return load_exercise(LESSON)


start_launches_first = start_first("script_run", __file__)  # while the other checks run


@pytest.fixture(scope="session")
def script_run(tmp_path_factory):
    checkpoint = tmp_path_factory.mktemp("checkpoints") / "tp.pt"
    run = start_script(SCRIPT, *TRAIN, "--tp", "2", "--batch-size", "8", "--checkpoint",
                       str(checkpoint), launcher="torchrun", nproc=4)
    yield run, checkpoint
    run.stop()
