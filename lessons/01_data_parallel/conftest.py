"""Lesson 01's fixtures, shared by its test files: ``ex`` (the graded exercises), a fresh
record of TinyNet's forwards for every test, and ``train_runs``, this lesson's train.py and
lesson 00's, started in the background before the lesson's first test (in whichever file) when
a selected test uses them."""

from __future__ import annotations

import pytest

from harness.exercises import LESSONS_DIR, load_exercise
from harness.launch import start_first, start_script
from lesson01.common import BASE_LESSON, LESSON, TRAIN_ARGS, clear_call_record


@pytest.fixture(scope="module")
def ex():
    return load_exercise(LESSON)


@pytest.fixture(autouse=True)
def fresh_call_record():
    clear_call_record()
    yield
    clear_call_record()


start_train_runs_first = start_first("train_runs", __file__)  # while the other checks run


@pytest.fixture(scope="session")
def train_runs():
    runs = {lesson: start_script(LESSONS_DIR / lesson / "train.py", *TRAIN_ARGS)
            for lesson in (BASE_LESSON, LESSON)}  # start_script adds --result, .data reads it
    yield runs
    for run in runs.values():
        run.stop()
