"""The pytest plugin that turns the lessons' tests into a grader.

- ``--solutions`` (or ``COURSE_SOLUTIONS=1``) grades ``solutions/`` instead of your files; the
  choice is put in the environment so every rank process and ``torchrun`` child sees it.
- A test that reaches an untouched stub (``NotImplementedError("taskN_M: ...")``), in this process
  or inside a rank, is reported as skipped, "not attempted yet". ``COURSE_STRICT=1`` makes it fail.
- Tests carry a task marker (``@pytest.mark.task3_2``) so one task can be run with ``-m task3_2``;
  a marker is registered for each task id a lesson's test files mark (the ids the stubs raise).
- The run ends with a per-lesson progress table.

CI's shortcut (``--solutions`` leaves out the lesson checks the same CI run's learner run passed)
is another plugin, ``tests/course/ci_grading.py``, which only ``.ci/run`` loads.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict

import pytest

from harness.exercises import (
    LESSONS_DIR,
    SOLUTIONS_ENV,
    TASK_MARK,
    lesson_names,
    solutions_mode,
    strict_mode,
    task_of,
)
from harness.launch import outside_launcher  # noqa: F401 - a fixture for every lesson's tests

MARKED_TASK = re.compile(r"\bmark\.(task\d+_\d+)\b")
LESSON_DIR = re.compile(r"(?:^|/)lessons/(\d\d_[^/]+)/")
HARDWARE_SKIP_PREFIX = "needs "  # harness.hardware words every hardware skip this way


def marked_tasks(lesson: str) -> list[str]:
    """The task ids the lesson's test files mark (``@pytest.mark.task3_2``), in order. Not read
    from the stubs: an exercise whose tasks are all answered has none left. tests/test_course.py
    checks that they are the ids the stubs raise."""
    found: dict[str, None] = {}
    for path in sorted((LESSONS_DIR / lesson).glob("test_*.py")):
        found.update(dict.fromkeys(MARKED_TASK.findall(path.read_text(encoding="utf-8"))))
    return sorted(found, key=_task_order)


def pytest_addoption(parser):
    group = parser.getgroup("course")
    group.addoption(
        "--solutions",
        action="store_true",
        help="grade the reference answers in solutions/ instead of your files in lessons/",
    )


def pytest_configure(config):
    if config.getoption("--solutions", default=False):
        os.environ[SOLUTIONS_ENV] = "1"
    for lesson in lesson_names():  # each task a lesson's tests mark is a marker
        for task in marked_tasks(lesson):
            config.addinivalue_line("markers", f"{task}: a task of lessons/{lesson}")
    config.pluginmanager.register(ProgressReport(), "course-progress")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """A test that waits on scripts a lesson launches must be marked slow (checked here, once
    every lesson's conftest has said which of its fixtures launch)."""
    from harness.launch import unmarked_launch_users

    unmarked = unmarked_launch_users(items)
    if unmarked:
        raise pytest.UsageError(f"{', '.join(unmarked)} waits on scripts its lesson launches: "
                                f"mark it @pytest.mark.slow")


def pytest_report_header(config):
    graded = "solutions/ (reference answers)" if solutions_mode() else "lessons/ (your files)"
    strict = ", strict: untouched stubs fail" if strict_mode() else ""
    return f"course: grading {graded}{strict}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.excinfo is None or report.when not in ("setup", "call"):
        return report
    task = task_of(call.excinfo.value)
    if task is None:
        return report
    message = str(call.excinfo.value).strip()
    if solutions_mode():
        report.longrepr = f"the reference solution is unfinished: {message}"
    elif strict_mode():
        report.longrepr = f"not attempted yet (COURSE_STRICT=1 counts this as a failure): {message}"
    else:
        report.outcome = "skipped"
        path, lineno, _ = item.location
        own = sorted((mark.name for mark in item.iter_markers() if TASK_MARK.match(mark.name)),
                     key=_task_order)
        if own and task not in own:  # this task's test uses an earlier task's answer
            report.user_properties.append(("waits_on", task))
            message = (f"{task} first: this test of {', '.join(own)} uses its answer, still a "
                       f"stub ({message})")
        report.longrepr = (str(item.path), lineno + 1, f"not attempted yet: {message}")
    return report


def _outcome(report) -> str:
    if report.passed:
        return "passed"
    if report.failed:
        return "failed"
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return "not attempted" if "not attempted yet" in reason else "skipped"


def _task_status(outcomes: set[str]) -> str:
    for status in ("failed", "not attempted", "waiting", "passed"):
        if status in outcomes:
            return status
    return "skipped"


def _task_order(task: str):
    lesson, number = task.removeprefix("task").split("_")
    return int(lesson), int(number)


class ProgressReport:
    """Collects each lesson test's outcome and prints the per-lesson table at the end."""

    def __init__(self):
        # lesson -> task id -> outcomes of its tests; lesson -> counts for checks of no task
        self.tasks: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
        self.checks: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        # lesson -> tasks that `-m` / `-k` left out of this run, so the totals stay the lesson's
        self.not_run: dict[str, set[str]] = defaultdict(set)

    def pytest_deselected(self, items):
        for item in items:
            match = LESSON_DIR.search(item.nodeid.replace(os.sep, "/"))
            if match:
                self.not_run[match.group(1)].update(
                    mark.name for mark in item.iter_markers() if TASK_MARK.match(mark.name))

    def pytest_runtest_logreport(self, report):
        if report.when != "call" and not (report.failed or report.skipped):
            return
        match = LESSON_DIR.search(report.nodeid.replace(os.sep, "/"))
        if match is None:
            return
        lesson = match.group(1)
        tasks = [kw for kw in report.keywords if TASK_MARK.match(kw)]
        outcome = _outcome(report)
        waits_on = dict(report.user_properties).get("waits_on")
        if waits_on:  # that task's stub is what stopped this one
            self.tasks[lesson][waits_on].add("not attempted")
            outcome = "waiting"
        for task in tasks:
            self.tasks[lesson][task].add(outcome)
        if not tasks:
            self.checks[lesson][outcome] += 1

    def pytest_terminal_summary(self, terminalreporter):
        if not (self.tasks or self.checks):
            return
        write = terminalreporter.write_line
        graded = "solutions/" if solutions_mode() else "your files in lessons/"
        terminalreporter.section(f"course progress (grading {graded})", sep="=")
        unfinished: list[tuple[str, str, str]] = []  # (lesson, task, status), in course order
        lessons = sorted(set(self.tasks) | set(self.checks))
        width = max(21, *(len(lesson) + 2 for lesson in lessons))  # a column for the names
        for lesson in lessons:
            by_status: dict[str, list[str]] = defaultdict(list)
            for task in sorted(self.tasks[lesson], key=_task_order):
                status = _task_status(self.tasks[lesson][task])
                by_status[status].append(task)
                if status in ("failed", "not attempted", "waiting"):
                    unfinished.append((lesson, task, status))
            not_run = sorted(self.not_run[lesson] - set(self.tasks[lesson]), key=_task_order)
            total = sum(len(v) for v in by_status.values()) + len(not_run)
            parts = [f"{len(by_status['passed'])}/{total} tasks passed"] if total else []
            for status, label in (("failed", "failing"), ("not attempted", "not attempted"),
                                  ("waiting", "waiting on an earlier task"),
                                  ("skipped", "skipped for hardware")):
                if by_status[status]:
                    parts.append(f"{label}: {', '.join(by_status[status])}")
            if not_run:
                parts.append(f"not graded in this run: {', '.join(not_run)}")
            if self.checks[lesson]:
                counts = ", ".join(f"{n} {k}" for k, n in sorted(self.checks[lesson].items()))
                parts.append(f"lesson checks: {counts}")
            write(f"{lesson:<{width}}" + "; ".join(parts))
        if unfinished:
            lesson, task, status = min(unfinished, key=lambda u: _task_order(u[1]))
            what = {"failed": "fails", "not attempted": "is not attempted yet",
                    "waiting": "waits on an earlier task's answer"}[status]
            write(f"Next: {task} {what}. Edit lessons/{lesson}/exercises.py (search for "
                  f"{task}), then run:")
            write(f"    pytest lessons/{lesson} -m {task}")
        elif any(self.not_run.values()):
            lessons = " ".join(f"lessons/{name}" for name in sorted(self.not_run)
                               if self.not_run[name])
            write(f"Every task graded in this run passed. Grade the rest:  pytest {lessons}")
