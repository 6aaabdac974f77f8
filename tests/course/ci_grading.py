"""CI's shortcut, a pytest plugin that only ``.ci/run`` loads (``pytest -p course.ci_grading``).

``.ci/run`` grades the course twice, learner mode then ``--solutions``. A lesson check (a test
of no task) runs the same code in both unless it reaches the exercises, so with ``--solutions``
one that passed in this CI run's learner run ($COURSE_CI_REPORTS/learner.xml) is not run again:
mostly torchrun launches, minutes of CI. A learner's ``pytest`` never loads this file; the
course's own plugin is ``harness/grading.py``.
"""

from __future__ import annotations

import ast
import functools
import os
from pathlib import Path

import pytest

from harness.exercises import TASK_MARK, grader_files, solutions_mode

ALREADY_PASSED = pytest.StashKey[int]()  # lesson checks --solutions left out in CI


@functools.cache
def _names_used(folder: Path) -> dict[str, set[str]]:
    """Each top-level function or class of a lesson's test code (its test files, its
    conftest.py and the helpers they share in common.py): the names it uses. One graph for the
    folder, so a test reaches what its fixtures and shared helpers reach; two files defining
    one name only merge their uses, which can keep a check, never drop one."""
    graph: dict[str, set[str]] = {}
    for path in grader_files(folder):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                graph.setdefault(node.name, set()).update(
                    n.id for n in ast.walk(node) if isinstance(n, ast.Name))
    return graph


def _reaches_the_exercises(item) -> bool:
    """Whether a test uses the ``ex`` fixture or calls, through its lesson's own test code,
    ``load_exercise``: the one place where learner and solutions runs differ."""
    module, fixtures = getattr(item, "module", None), getattr(item, "fixturenames", ())
    if "ex" in fixtures or module is None:  # not a test function: keep it
        return True
    graph = _names_used(Path(module.__file__).resolve().parent)
    seen, todo = set(), [getattr(item, "originalname", item.name), *fixtures]
    while todo:
        name = todo.pop()
        if name == "load_exercise":
            return True
        if name not in seen:
            seen.add(name)
            todo += graph.get(name, ())
    return False


def pytest_collection_modifyitems(config, items):
    """In CI only, with --solutions: a lesson check (a test of no task) that passed in this CI
    run's learner run ($COURSE_CI_REPORTS/learner.xml) is not run again, unless it reaches the
    exercises (the ``ex`` fixture, or ``load_exercise`` through the lesson's test code). It
    would run the same code a second time: mostly torchrun launches."""
    from course.selfcheck import read_report
    from harness.launch import CI_REPORTS_ENV

    learner = Path(os.environ.get(CI_REPORTS_ENV, "")) / "learner.xml"
    if not (solutions_mode() and os.environ.get(CI_REPORTS_ENV) and learner.is_file()):
        return
    passed = {node for node, (outcome, _) in read_report(learner).items() if outcome == "passed"}
    again, done = [], []
    for item in items:
        path, _, name = item.nodeid.partition("::")
        report_id = f"{path.removesuffix('.py').replace('/', '.')}::{name}"
        untasked = not any(TASK_MARK.match(mark.name) for mark in item.iter_markers())
        same_in_both = untasked and report_id in passed and not _reaches_the_exercises(item)
        (done if same_in_both else again).append(item)
    if done:
        config.hook.pytest_deselected(items=done)
        items[:] = again
        config.stash[ALREADY_PASSED] = len(done)


def pytest_report_collectionfinish(config, start_path, items):
    count = config.stash.get(ALREADY_PASSED, 0)
    if count:
        return (f"course: {count} lesson checks (tests of no task) passed in this CI run's "
                f"learner run; not run again")
    return None


