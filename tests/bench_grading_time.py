"""Benchmark: how long a learner waits for the grader, against the course's targets.

    python tests/bench_grading_time.py            # every lesson, every task, then the whole course
    python tests/bench_grading_time.py --lessons 04,05

Runs, one after the other, on the course's 2-core CPU machine:

- ``pytest lessons/NN`` in learner mode on the checkout as it is (a fresh clone: every stub
  untouched, so this is the lesson's own checks plus the skipped tasks): target 30 s a lesson;
- ``pytest lessons/NN -m TASK --solutions`` for every task (what a learner waits for once the
  task is solved: every test of it runs): target 10 s a task;
- ``pytest --solutions`` (the whole course's reference answers): target 4 minutes.

Each row prints its seconds, its target, and ``over`` where it misses. Run it on a quiet
machine: these are measurements, not tests, and other work on the machine slows every number.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lessons"))
from harness.exercises import (  # noqa: E402
    REPO_ROOT,
    lesson_names,
    tasks_of,  # noqa: E402
)

LESSON_TARGET = 30.0  # s: pytest lessons/NN in learner mode
TASK_TARGET = 10.0  # s: one solved task's tests
COURSE_TARGET = 240.0  # s: pytest --solutions


def timed(*args: str) -> tuple[float, int]:
    env = {k: v for k, v in os.environ.items() if k not in ("COURSE_SOLUTIONS", "COURSE_STRICT")}
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                         cwd=REPO_ROOT, env=env, capture_output=True, timeout=1200)
    return time.perf_counter() - started, run.returncode


def row(name: str, seconds: float, target: float, code: int) -> bool:
    over = seconds > target
    print(f"{name:<58} {seconds:>7.1f} {target:>7.0f}  {code:>4}  {'over' if over else ''}",
          flush=True)
    return over


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lessons", help="comma-separated lesson numbers (default: all, and "
                                          "the whole course's pytest --solutions)")
    args = parser.parse_args(argv)
    chosen = [lesson for lesson in lesson_names()
              if not args.lessons or lesson[:2] in args.lessons.split(",")]
    print(f"{'command':<58} {'seconds':>7} {'target':>7}  exit")
    misses = 0
    for lesson in chosen:
        seconds, code = timed(f"lessons/{lesson}")
        misses += row(f"pytest lessons/{lesson}", seconds, LESSON_TARGET, code)
        for task in tasks_of(lesson):
            seconds, code = timed(f"lessons/{lesson}", "-m", task, "--solutions")
            misses += row(f"  -m {task} --solutions", seconds, TASK_TARGET, code)
    if not args.lessons:
        seconds, code = timed("--solutions")
        misses += row("pytest --solutions", seconds, COURSE_TARGET, code)
    print(f"{misses} over target" if misses else "every row within its target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
