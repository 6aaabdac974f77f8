"""The known-wrong-answers suite: each grader rejects the mistakes learners really make.

Every file ``tests/wrong_answers/<lesson>/<task>_<what>.py`` is one wrong answer, kept as data:

    \"\"\"Sums the gradients but never divides by the world size.\"\"\"   # the table's name for it
    TASK = "task3_3"                         # the task whose grader must reject it
    EXPECT = r"divide by the world size"     # a regex the failure message must match

    def average_gradients(model): ...        # replaces the same-named function in the solution

or, for a mistake of a line or two, that change alone (``course.selfcheck.with_wrong_answer``):

    REPLACE = {"average_gradients": [("p.grad /= world", "pass")]}

Each is put into a scratch copy of the course (the reference solution with that one function or
class replaced) and graded there in learner mode with ``pytest lessons/<lesson> -m <task> -x``.
It must fail, and its first failure (the message a learner reads first) must say what is
wrong, within the time limit, leaving no process behind. A control run per lesson grades the
unmodified solution the same way (every test) and must pass, so a wrong answer cannot be
"caught" by a broken scratch copy. The run ends with a table (each
test leaves its row in ``user_properties``; tests/conftest.py prints them).
"""

from __future__ import annotations

import ast
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from course.manifest import lesson as course_lesson
from course.selfcheck import (
    processes_under,
    run_lesson_tests,
    scratch_course,
    with_wrong_answer,
)
from harness.exercises import LESSONS_DIR, SOLUTIONS_DIR, lesson_names, tasks_of

WRONG_ANSWERS_DIR = Path(__file__).parent / "wrong_answers"
WRONG_ANSWERS = sorted(WRONG_ANSWERS_DIR.glob("*/task*.py"))
RUN_TIMEOUT = 240.0  # seconds for one graded run; most take 3-8 s
# Most of a graded run is importing torch or waiting on a timeout: three overlap on 2 cores.
PARALLEL_RUNS = 3


def read_wrong_answer(path: Path) -> dict:
    """The wrong answer's description, TASK and EXPECT, read without running it."""
    tree = ast.parse(path.read_text())
    constants = {node.targets[0].id: ast.literal_eval(node.value) for node in tree.body
                 if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)}
    description = ast.get_docstring(tree) or ""
    return {"lesson": path.parent.name, "name": path.stem, "task": constants.get("TASK"),
            "expect": constants.get("EXPECT"), "description": description.splitlines()[0]
            if description else ""}


def grade_in_scratch(tmp: Path, lesson: str, task: str, exercise_source: str,
                     first_failure: bool = True) -> dict:
    """Grade ``exercise_source`` as the learner's exercises.py for ``task``, in a scratch copy.

    ``first_failure``: stop at the first failing test (``-x``), as a learner reads the first
    message first; that message must say what is wrong. The controls run every test."""
    root = scratch_course(tmp / "course")
    (root / "lessons" / lesson / "exercises.py").write_text(exercise_source)
    started = time.monotonic()
    outcomes = run_lesson_tests(lesson, tmp, "-m", task, *["-x"] * first_failure, root=root,
                                timeout=RUN_TIMEOUT)
    seconds = time.monotonic() - started
    left = processes_under(root)
    return {"outcomes": outcomes, "seconds": seconds, "left_behind": left}


def task_of(lesson: str, name: str) -> str | None:
    """The task whose reference answer defines ``name``, per the manifest."""
    entry = course_lesson(lesson)
    return next((task for task, sections in entry.tasks.items()
                 if name in {s.strip() for s in sections.split(",")}), None)


def script_copies() -> list[tuple[str, str, str]]:
    """(lesson, file, name) for every script or module of the manifest that defines, at top
    level, a function or class that a task grades: it keeps its own copy (a script runs without
    the solutions), and the copy must be a right answer to that task."""
    found = []
    for lesson in lesson_names():
        entry = course_lesson(lesson)
        for name in (*(script.path for script in entry.scripts), *entry.modules):
            path = LESSONS_DIR / lesson / name
            for node in ast.parse(path.read_text()).body:
                if (isinstance(node, (ast.FunctionDef, ast.ClassDef))
                        and task_of(lesson, node.name)):
                    found.append((lesson, name, node.name))
    return found


# A script function that shares only its name with a task: what the task asks is another thing.
NOT_A_COPY = {
    ("03_ddp", "train_ddp.py", "train_one_epoch"):
        "task3_4 asks for an epoch of DDP by hand, over a loader that records what it yields",
}


def copy_source(lesson: str, script: str, name: str) -> str:
    source = (LESSONS_DIR / lesson / script).read_text()
    node = next(n for n in ast.parse(source).body if getattr(n, "name", None) == name)
    return ast.get_source_segment(source, node) + "\n"


@pytest.fixture(scope="module")
def graded(request, tmp_path_factory):
    """Start every selected graded run (controls and wrong answers) at once; tests collect them."""
    selected = {item.callspec.params.get(key) for item in request.session.items
                if hasattr(item, "callspec") for key in ("lesson", "path", "copy")}
    pool = ThreadPoolExecutor(max_workers=PARALLEL_RUNS)
    runs = {}
    for lesson in lesson_names():
        if lesson in selected:
            solution = (SOLUTIONS_DIR / lesson / "exercises.py").read_text()
            runs[("control", lesson)] = pool.submit(
                grade_in_scratch, tmp_path_factory.mktemp(f"control-{lesson}"), lesson,
                " or ".join(tasks_of(lesson)), solution, first_failure=False)
    for path in WRONG_ANSWERS:
        if path in selected:
            info = read_wrong_answer(path)
            solution = (SOLUTIONS_DIR / info["lesson"] / "exercises.py").read_text()
            source = with_wrong_answer(solution, path.read_text())
            runs[path] = pool.submit(grade_in_scratch, tmp_path_factory.mktemp(path.stem),
                                     info["lesson"], info["task"], source)
    for copy in script_copies():
        if copy in selected and copy not in NOT_A_COPY:
            lesson, script, name = copy
            solution = (SOLUTIONS_DIR / lesson / "exercises.py").read_text()
            source = with_wrong_answer(solution, copy_source(*copy))
            runs[copy] = pool.submit(grade_in_scratch, tmp_path_factory.mktemp(name), lesson,
                                     task_of(lesson, name), source, first_failure=False)
    yield runs
    for future in runs.values():
        future.cancel()
    pool.shutdown(wait=True)


@pytest.mark.timeout(RUN_TIMEOUT * 2)  # its run may wait in the queue behind another
@pytest.mark.parametrize("lesson", lesson_names())
def test_the_unmodified_solution_passes_in_a_scratch_copy(graded, lesson):
    run = graded[("control", lesson)].result()
    bad = {node: text[:300] for node, (outcome, text) in run["outcomes"].items()
           if outcome in ("failure", "error")}
    assert not bad, f"the reference solution fails in the scratch copy: {bad}"
    assert any(outcome == "passed" for outcome, _ in run["outcomes"].values())
    assert not run["left_behind"], f"processes left behind: {run['left_behind']}"


def test_every_task_has_at_least_three_wrong_answers():
    have: dict[str, int] = {}
    for path in WRONG_ANSWERS:
        task = read_wrong_answer(path)["task"]
        have[task] = have.get(task, 0) + 1
    missing = {task: have.get(task, 0) for lesson in lesson_names() for task in tasks_of(lesson)
               if have.get(task, 0) < 3}
    assert not missing, f"tasks with fewer than three known wrong answers: {missing}"


@pytest.mark.timeout(RUN_TIMEOUT * 2)
@pytest.mark.parametrize("path", WRONG_ANSWERS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_the_grader_rejects_the_wrong_answer(graded, path, request):
    info = read_wrong_answer(path)
    assert info["task"] in tasks_of(info["lesson"]), f"{path.name}: unknown TASK {info['task']}"
    assert info["expect"] and info["description"], f"{path.name}: needs a docstring and EXPECT"
    run = graded[path].result()
    failures = [text for outcome, text in run["outcomes"].values()
                if outcome in ("failure", "error")]
    first_line = failures[0].splitlines()[0] if failures and failures[0] else ""
    caught = bool(failures) and any(re.search(info["expect"], text) for text in failures)
    request.node.user_properties.append(
        ("wrong_answer", (info["task"], info["name"], caught, run["seconds"], first_line)))
    outcomes = {node: (outcome, text[:200]) for node, (outcome, text) in run["outcomes"].items()}
    assert failures, f"{path.name}: the grader accepted this wrong answer: {outcomes}"
    assert caught, (
        f"{path.name}: rejected, but no message matches {info['expect']!r}: {failures[0][:1500]}"
    )
    assert not run["left_behind"], f"processes left behind: {run['left_behind']}"



@pytest.mark.timeout(RUN_TIMEOUT * 2)
@pytest.mark.parametrize("copy", [c for c in script_copies() if c not in NOT_A_COPY],
                         ids=lambda c: f"{c[0]}/{c[1]}:{c[2]}")
def test_a_script_copy_of_a_task_passes_its_grader(graded, copy):
    """A script or module that defines what a task grades (train_tp.py's block_plan,
    training_state.py's ResumableSampler, ...) keeps its own copy, shorter than the reference
    answer; the task's grader, run on the copy in place of the reference, keeps the two the same
    function."""
    lesson, script, name = copy
    run = graded[copy].result()
    bad = {node: text[:600] for node, (outcome, text) in run["outcomes"].items()
           if outcome in ("failure", "error")}
    assert not bad, (f"lessons/{lesson}/{script}'s {name} fails {task_of(lesson, name)}'s "
                     f"grader: make it a right answer, as the reference is: {bad}")
    assert any(outcome == "passed" for outcome, _ in run["outcomes"].values())


def test_every_name_that_is_not_a_copy_is_still_defined_by_its_script():
    gone = set(NOT_A_COPY) - set(script_copies())
    assert not gone, f"NOT_A_COPY names what no script defines any more: {gone}"
