"""Benchmark: how long a learner waits for the grader, against the course's targets.

    python tests/bench_grading_time.py

Runs, one after the other, ``pytest lessons/NN`` in learner mode for each lesson and the whole
course's ``pytest --solutions``, and prints the wall-clock seconds of each next to its target
(lesson 03, real torchrun launches included: 20 s; lesson 05: 25 s; ``pytest --solutions``:
90 s; on the course's 2-core CPU machine). Run it on a quiet machine: these are measurements,
not tests, and other work on the machine slows every number.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lessons"))
from harness.exercises import REPO_ROOT, lesson_names  # noqa: E402

TARGETS = {"pytest lessons/03_ddp": 20.0, "pytest lessons/05_sharded_data_parallel": 25.0,
           "pytest lessons/06_tensor_parallel": 25.0, "pytest lessons/07_pipeline_parallel": 25.0,
           "pytest --solutions": 90.0}


def timed(*args: str) -> tuple[float, int]:
    env = {k: v for k, v in os.environ.items() if k not in ("COURSE_SOLUTIONS", "COURSE_STRICT")}
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", *args],
                         cwd=REPO_ROOT, env=env, capture_output=True, timeout=1200)
    return time.perf_counter() - started, run.returncode


def main() -> None:
    rows = [(f"pytest lessons/{lesson}", f"lessons/{lesson}") for lesson in lesson_names()]
    rows.append(("pytest --solutions", "--solutions"))
    print(f"{'command':<36} {'seconds':>8} {'target':>7}  exit")
    for name, arg in rows:
        seconds, code = timed(arg)
        target = TARGETS.get(name)
        shown = f"{target:>7.0f}" if target else f"{'-':>7}"
        print(f"{name:<36} {seconds:>8.1f} {shown}  {code}", flush=True)


if __name__ == "__main__":
    main()
