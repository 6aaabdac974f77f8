"""Lesson 04's fixtures, shared by its test files: ``ex`` (the graded exercises) and
``launches``, every real launch of the lesson (the notebook lab, the doctor), that
test_04_pitfalls.py's slow checks read. The launches start together, before the lesson's first
test (in whichever file) when a selected test uses them: most of a launch is
Python importing torch, which overlaps well, with each other and with the pooled checks' waits
on a short process-group timeout.
"""

from __future__ import annotations

import pytest

from harness.exercises import load_exercise
from harness.launch import start_first, start_script
from lesson04.common import DOCTOR, LESSON

NOTEBOOK_LAB = f"lessons/{LESSON}/labs/14_notebooks.py"


@pytest.fixture
def ex():
    return load_exercise(LESSON)


start_launches_first = start_first("launches", __file__)  # while the other checks run


@pytest.fixture(scope="session")
def launches():
    runs = {
        "notebook": start_script(NOTEBOOK_LAB, timeout=120),
        "notebook --fix": start_script(NOTEBOOK_LAB, "--fix", timeout=120),
        "doctor": start_script(DOCTOR, "--timeout", "30", "--sizes", "1,4", launcher="torchrun",
                               nproc=2),
        "doctor, python": start_script(DOCTOR, "--timeout", "30"),
        "doctor, stall": start_script(DOCTOR, "--timeout", "5", "--simulate-stall", "1",
                                      launcher="torchrun", nproc=2, check=False, timeout=90),
        "doctor, crash": start_script(DOCTOR, "--timeout", "30", "--simulate-crash", "1",
                                      launcher="torchrun", nproc=2, check=False, timeout=90),
        # One process stuck where no torch timeout applies: only the doctor's deadline helps.
        "doctor, stuck alone": start_script(DOCTOR, "--timeout", "1", "--simulate-stall", "0",
                                            check=False, timeout=90),
    }
    yield runs
    for run in runs.values():
        run.stop()
