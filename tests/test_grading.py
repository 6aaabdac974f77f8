"""The grading plugin, run on a small throw-away lesson: skips, strict mode, selection, summary."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from harness.exercises import REPO_ROOT

DEMO_TEST = '''
import pytest
from harness.ranks import run_on_ranks

def stub(ctx=None):
    raise NotImplementedError("task9_1: write the thing")

def rank_stub(ctx):
    raise NotImplementedError("task9_4: write the rank thing")

@pytest.mark.task9_1
def test_untouched_stub():
    stub()

@pytest.mark.task9_2
def test_done():
    assert 1 + 1 == 2

@pytest.mark.task9_3
def test_wrong():
    assert 1 + 1 == 3, "rank 0: parameter 'w' differs by 1"

@pytest.mark.task9_4
def test_stub_inside_a_rank():
    run_on_ranks(rank_stub, world_size=2)

def test_a_lesson_claim():
    assert True
'''


def make_demo(root, test_source: str = DEMO_TEST):
    lesson = root / "lessons" / "99_demo"
    lesson.mkdir(parents=True)
    (lesson / "test_99_demo.py").write_text(test_source)
    (root / "pytest.ini").write_text(textwrap.dedent("""
        [pytest]
        addopts = --import-mode=importlib --strict-markers -p harness.grading -p no:cacheprovider
        markers =
            task9_1: demo
            task9_2: demo
            task9_3: demo
            task9_4: demo
    """))
    return root


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return make_demo(tmp_path_factory.mktemp("course"))


def run_pytest(root, *args, **env):
    path = os.pathsep.join(str(REPO_ROOT / folder) for folder in ("lessons", "tests"))
    environment = {**os.environ, "PYTHONPATH": path, **env}
    for name in ("COURSE_STRICT", "COURSE_SOLUTIONS"):
        if name not in env:
            environment.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-rs", *args], cwd=root, env=environment,
        capture_output=True, text=True, timeout=120,
    )


def test_learner_mode_skips_untouched_stubs_and_prints_progress(demo):
    run = run_pytest(demo)
    out = run.stdout
    assert run.returncode == 1, out  # task9_3 is wrong
    assert "2 passed" in out and "1 failed" in out and "2 skipped" in out, out
    assert "not attempted yet: task9_1: write the thing" in out
    assert "not attempted yet: task9_4: write the rank thing (reached on rank 0)" in out
    assert "rank 0: parameter 'w' differs by 1" in out
    assert "course progress (grading your files in lessons/)" in out
    line = next(line for line in out.splitlines() if line.startswith("99_demo"))
    assert "1/4 tasks passed" in line
    assert "failing: task9_3" in line
    assert "not attempted: task9_1, task9_4" in line
    assert "lesson checks: 1 passed" in line
    # The table ends with the concrete next command: the first unfinished task, in task order.
    assert "Next: task9_1 is not attempted yet." in out, out
    assert "    pytest lessons/99_demo -m task9_1" in out, out


USES_AN_EARLIER_ANSWER = '''
import pytest

def stub():
    raise NotImplementedError("task9_1: write the thing")

@pytest.mark.task9_1
def test_untouched_stub():
    stub()

@pytest.mark.task9_2
def test_uses_task9_1s_answer():
    stub()

@pytest.mark.task9_2
def test_its_own_part():
    assert True
'''


def test_a_task_that_uses_an_earlier_untouched_answer_waits_on_it(tmp_path):
    """task9_2's test reaches task9_1's stub: task9_2 is written, not "not attempted"; the
    summary says it waits, and the next command is task9_1's, even when only task9_2 ran."""
    demo = make_demo(tmp_path / "course", USES_AN_EARLIER_ANSWER)
    run = run_pytest(demo, "-m", "task9_2")
    out = run.stdout
    assert run.returncode == 0, out
    assert ("not attempted yet: task9_1 first: this test of task9_2 uses its answer, still a "
            "stub (task9_1: write the thing)") in out, out
    line = next(line for line in out.splitlines() if line.startswith("99_demo"))
    assert "not attempted: task9_1" in line and "waiting on an earlier task: task9_2" in line, line
    assert "Next: task9_1 is not attempted yet." in out, out
    assert "    pytest lessons/99_demo -m task9_1" in out, out


def test_strict_mode_fails_untouched_stubs(demo):
    run = run_pytest(demo, COURSE_STRICT="1")
    assert "3 failed" in run.stdout, run.stdout
    assert "COURSE_STRICT=1 counts this as a failure" in run.stdout


def test_one_task_can_be_selected(demo):
    run = run_pytest(demo, "-m", "task9_2")
    assert run.returncode == 0, run.stdout
    assert "1 passed, 4 deselected" in run.stdout
    # The lesson's totals stay the lesson's, and the rest is named as not graded in this run.
    line = next(line for line in run.stdout.splitlines() if line.startswith("99_demo"))
    assert "1/4 tasks passed" in line, line
    assert "not graded in this run: task9_1, task9_3, task9_4" in line, line
    assert "Grade the rest:  pytest lessons/99_demo" in run.stdout, run.stdout


def test_solutions_flag_reaches_the_environment(demo):
    run = run_pytest(demo, "--solutions", "-m", "task9_1")
    assert "grading solutions/ (reference answers)" in run.stdout
    # In solutions mode an unfinished stub is a failure, never a skip.
    assert "1 failed" in run.stdout and "the reference solution is unfinished" in run.stdout


READS_THE_EXERCISES = '''
from harness.exercises import load_exercise

def the_exercises():
    return load_exercise  # a test that can reach it may grade other code in each mode

def test_a_claim_through_the_exercises():
    assert the_exercises() is not None
'''


def test_in_ci_solutions_leave_out_the_lesson_checks_the_learner_run_passed(tmp_path):
    """.ci/run: `pytest --solutions` runs after the learner run; a test of no task that passed
    there is not run again, unless it can reach the exercises. Tests of a task always run, and
    nothing happens outside CI."""
    demo = make_demo(tmp_path / "course", DEMO_TEST + READS_THE_EXERCISES)
    reports = tmp_path / "reports"
    reports.mkdir()
    learner = run_pytest(demo, f"--junitxml={reports / 'learner.xml'}")
    assert "1 failed" in learner.stdout, learner.stdout
    ci = ("-p", "course.ci_grading")  # only .ci/run loads the shortcut
    run = run_pytest(demo, "--solutions", *ci, "-m", "not task9_1 and not task9_4",
                     COURSE_CI_REPORTS=str(reports))
    assert "course: 1 lesson checks (tests of no task) passed in this CI run's learner run" in (
        run.stdout), run.stdout
    assert "1 failed, 2 passed, 3 deselected" in run.stdout, run.stdout  # 9_3; 9_2, exercises
    # A learner's pytest (the course's plugin alone) runs everything, even beside a report.
    run = run_pytest(demo, "--solutions", "-m", "not task9_1 and not task9_4",
                     COURSE_CI_REPORTS=str(reports))
    assert "1 failed, 3 passed, 2 deselected" in run.stdout, run.stdout
    (reports / "learner.xml").unlink()
    run = run_pytest(demo, "--solutions", *ci, "-m", "not task9_1 and not task9_4",
                     COURSE_CI_REPORTS=str(reports))
    assert "1 failed, 3 passed, 2 deselected" in run.stdout, run.stdout


def test_ci_shortcut_follows_the_helpers_a_lessons_test_files_share():
    """A lesson check reaches the exercises through common.py as surely as through its own
    file: lesson 03's trajectory check calls common.train_epochs, which loads the exercise, so
    CI's --solutions run must not leave it out as already passed."""
    from course.ci_grading import _names_used

    graph = _names_used(REPO_ROOT / "lessons" / "03_ddp")
    assert "train_epochs" in graph["test_ddp_trajectory_equals_one_process_on_global_batches"]
    assert "load_exercise" in graph["train_epochs"]
