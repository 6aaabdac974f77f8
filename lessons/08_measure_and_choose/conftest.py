"""Lesson 08's fixtures, shared by its test files: ``ex`` (the graded exercises) and
``launches``, the benchmark scripts at tiny sizes (bench_collectives.py and ddp_costs.py under
torchrun, compare_methods.py), whose results test_08_measure_and_choose.py's slow checks read.
They start in the background before the lesson's first test (in whichever file) when a selected
test uses them.
"""

from __future__ import annotations

import pytest

from harness.exercises import load_exercise
from harness.launch import start_first, start_script
from lesson08.common import BENCH, LESSON, METHODS, TINY

COSTS = f"lessons/{LESSON}/ddp_costs.py"


@pytest.fixture
def ex():
    return load_exercise(LESSON)


@pytest.fixture(scope="session")
def launches(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    bench = start_script(BENCH, "--max-bytes", "16384", "--steps", "1", "--warmup", "1",
                         "--csv", str(folder / "c.csv"), "--plot", str(folder / "c.svg"),
                         launcher="torchrun", nproc=2)
    costs = start_script(COSTS, "--width", "32", "--blocks", "2", "--context", "16",
                         "--steps", "1", "--settings", "0,3,4",
                         "--trace", str(folder / "trace.json"),
                         launcher="torchrun", nproc=2)
    methods = start_script(METHODS, *[f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()],
                           "--steps", "1", "--warmup", "1", "--csv", str(folder / "m.csv"),
                           timeout=300)
    yield {"bench": bench, "costs": costs, "methods": methods, "folder": folder}
    for launch in (bench, costs, methods):
        launch.stop()


start_launches_first = start_first("launches", __file__)  # while the other checks run
