"""Fixtures the test files of lesson 00 share: the graded module and the lesson's script."""

import pytest

from harness.exercises import load_exercise, load_lesson_module

LESSON = "00_single_gpu"


@pytest.fixture(scope="module")
def ex():
    return load_exercise(LESSON)


@pytest.fixture(scope="module")
def train():
    return load_lesson_module(LESSON, "train")
