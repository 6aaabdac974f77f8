"""Fixtures the test files of lesson 05 share: ``ex``, the graded module (yours, or the reference
answers with --solutions), and the script's torchrun run, started before the lesson's first test
so that its seconds of importing torch overlap the other checks."""

from __future__ import annotations

import pytest

from harness.exercises import load_exercise
from harness.launch import start_first, start_script
from lesson05.common import LESSON, SCRIPT, TRAIN_ONE_EPOCH

start_launches_first = start_first("script_runs", __file__)  # while the other checks run


@pytest.fixture
def ex():
    return load_exercise(LESSON)


@pytest.fixture(scope="session")
def script_runs(tmp_path_factory):
    """train_fsdp.py under torchrun, 2 ranks x 8, one epoch, saving its checkpoint: the launch
    and the checkpoint's path (test_05_sharded_data_parallel.py holds it to lesson 03's DDP)."""
    checkpoint = tmp_path_factory.mktemp("checkpoints") / "fsdp.pt"
    run = start_script(SCRIPT, *TRAIN_ONE_EPOCH, "--batch-size", "8", "--checkpoint",
                       str(checkpoint), launcher="torchrun", nproc=2)
    yield run, checkpoint
    run.stop()
