"""Lesson 10's fixtures, shared by its test files: ``ex`` (the graded exercises), and
``script_run`` and ``train_run``, the torchrun runs of ring_attention.py and train_cp.py that
test_10_long_sequences.py reads, started in the background before the lesson's first test when
a selected test uses them."""

from __future__ import annotations

import pytest

from harness.exercises import load_exercise
from harness.launch import start_first, start_script
from lesson10.common import LESSON, SCRIPT, SCRIPT_ARGS, TRAIN, TRAIN_SCRIPT


@pytest.fixture
def ex():
    return load_exercise(LESSON)


start_launches_first = start_first("script_run", __file__)  # while the other checks run
start_training_first = start_first("train_run", __file__)


@pytest.fixture(scope="session")
def script_run():
    run = start_script(SCRIPT, *SCRIPT_ARGS, launcher="torchrun", nproc=4)
    yield run
    run.stop()


@pytest.fixture(scope="session")
def train_run(tmp_path_factory):
    """train_cp.py on 4 ranks, dp 2 x cp 2, 8 windows per row: the global batch of one process
    of 16."""
    checkpoint = tmp_path_factory.mktemp("checkpoints") / "cp.pt"
    run = start_script(TRAIN_SCRIPT, *TRAIN, "--cp", "2", "--batch-size", "8", "--checkpoint",
                       str(checkpoint), launcher="torchrun", nproc=4)
    yield run, checkpoint
    run.stop()
