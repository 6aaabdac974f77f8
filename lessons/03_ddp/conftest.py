"""Lesson 03's fixtures that more than one of its test files uses: ``ex``, the graded
exercises (yours, or the reference answers with --solutions)."""

from __future__ import annotations

import pytest

from harness.exercises import load_exercise
from lesson03.common import LESSON


@pytest.fixture
def ex():
    return load_exercise(LESSON)
