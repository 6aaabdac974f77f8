"""Running the course's own tests from the outside, for the integrity suite under ``tests/``.

- :func:`run_lesson_tests` runs one lesson's tests in a fresh ``pytest`` process (so the graded
  mode is clean each time; forked from a server that has imported torch already, see
  ``tests/course/forkserver.py``) and returns each test's outcome and message;
  :func:`whole_course_outcomes` reads them from the reports CI has just written instead.
- :func:`scratch_course` copies the course into a temporary folder, where an exercise file can be
  replaced without touching the real one.
- :func:`with_wrong_answer` rewrites a reference solution with one known-wrong answer in it
  (a function, or the wrong methods of a class).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from course import forkserver
from harness.exercises import REPO_ROOT
from harness.launch import CI_REPORTS_ENV
from harness.processes import command_line, live_processes, working_directory

RUN_TIMEOUT = 300.0  # seconds for one lesson's tests; the pytest-timeout inside is shorter


def read_report(report: Path, lesson: str | None = None) -> dict[str, tuple[str, str]]:
    """{nodeid: (outcome, text)} from a pytest JUnit XML report, for one lesson or all.

    ``outcome`` is "passed", "failure", "error" or "skipped"; ``text`` is the failure's message
    followed by its full report (or the skip reason)."""
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        classname = case.get("classname") or ""
        if lesson is not None and not classname.startswith(f"lessons.{lesson}."):
            continue
        outcome, text = "passed", ""
        for kind in ("failure", "error", "skipped"):
            element = case.find(kind)
            if element is not None:
                outcome = kind
                text = f"{element.get('message') or ''}\n{element.text or ''}".strip()
        outcomes[f"{classname}::{case.get('name')}"] = (outcome, text)
    return outcomes


def run_lesson_tests(lesson: str, report_dir: Path, *args: str, root: Path = REPO_ROOT,
                     timeout: float = RUN_TIMEOUT, **env: str) -> dict[str, tuple[str, str]]:
    """Run ``pytest lessons/<lesson> *args`` under ``root``; return :func:`read_report`'s dict.

    The grading mode comes from ``env`` only: the caller's COURSE_SOLUTIONS / COURSE_STRICT are
    not inherited.
    """
    report = Path(report_dir) / f"report-{lesson}.xml"
    report.unlink(missing_ok=True)
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("COURSE_SOLUTIONS", "COURSE_STRICT", CI_REPORTS_ENV)}
    environment.update(env)
    pytest_args = [f"lessons/{lesson}", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                   *args]
    if forkserver.available():  # torch already imported: saves seconds per run
        code, output = forkserver.run_pytest(pytest_args, root, environment, timeout)
        if code == forkserver.TIMED_OUT:
            raise subprocess.TimeoutExpired(["pytest", *pytest_args], timeout, output)
    else:
        run = subprocess.run([sys.executable, "-m", "pytest", *pytest_args], cwd=root,
                             env=environment, capture_output=True, text=True, timeout=timeout)
        output = run.stdout + run.stderr
    assert report.exists(), f"pytest produced no report:\n{output}"
    outcomes = read_report(report)
    assert outcomes, f"no test ran for {lesson}:\n{output}"
    return outcomes


def whole_course_outcomes(lesson: str, mode: str, report_dir: Path) -> dict[str, tuple[str, str]]:
    """A lesson's outcomes in ``mode`` ("learner" or "solutions"), every test of it.

    CI has just run the whole course both ways (``pytest`` and ``pytest --solutions``, with
    ``--junitxml=$COURSE_CI_REPORTS/<mode>.xml``): read those reports instead of running the
    same tests again. Anywhere else, run the lesson's tests now.
    """
    saved = Path(os.environ.get(CI_REPORTS_ENV, "")) / f"{mode}.xml"
    if os.environ.get(CI_REPORTS_ENV) and saved.is_file():
        outcomes = read_report(saved, lesson)
        assert outcomes, f"{saved} has no test of {lesson}"
        return outcomes
    flags = ("--solutions",) if mode == "solutions" else ()
    return run_lesson_tests(lesson, report_dir, *flags)


def scratch_course(destination: Path) -> Path:
    """Copy what grading needs (lessons, solutions, pytest config) into ``destination``."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for folder in ("lessons", "solutions"):
        shutil.copytree(REPO_ROOT / folder, destination / folder, ignore=ignore)
    for name in ("pyproject.toml", "conftest.py"):
        shutil.copy2(REPO_ROOT / name, destination / name)
    return destination


def _replaced(tree: ast.Module) -> dict[str, ast.stmt]:
    return {node.name: node for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def _functions(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    return {node.name: node for node in body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _span(node: ast.stmt) -> tuple[int, int]:
    """First and last line of a definition, its decorators included (1-based)."""
    return min([node.lineno] + [d.lineno for d in node.decorator_list]), node.end_lineno


def _replacements(wrong_tree: ast.Module) -> dict[str, list[tuple[str, str]]]:
    """The wrong answer's ``REPLACE = {name: [(old, new), ...]}``, or nothing."""
    for node in wrong_tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == "REPLACE"):
            return ast.literal_eval(node.value)
    return {}


def with_wrong_answer(solution_source: str, wrong_source: str) -> str:
    """The solution with the wrong answer's definitions put in place of the same-named ones.

    A function replaces the solution's function. A class replaces only the methods it defines
    (so a wrong answer shows just the method that is wrong); the rest of the solution's class
    stays. A wrong answer that differs from the reference by a line or two says so instead:
    ``REPLACE = {"name": [(old, new), ...]}`` replaces, in the solution's definition of
    ``name``, each text ``old`` (which must occur there exactly once) with ``new``. The wrong
    answer's own top-level imports are added after the solution's imports; its other top-level
    statements (its docstring, TASK, EXPECT) are not copied.
    """
    solution_tree, wrong_tree = ast.parse(solution_source), ast.parse(wrong_source)
    lines, wrong_lines = solution_source.splitlines(), wrong_source.splitlines()
    targets = _replaced(solution_tree)
    edits: list[tuple[int, int, list[str]]] = []  # (first line, last line, new lines), 1-based
    for name, pairs in _replacements(wrong_tree).items():
        if name not in targets:
            raise ValueError(f"REPLACE names {name!r}, which the solution does not define")
        start, end = _span(targets[name])
        text = "\n".join(lines[start - 1:end])
        for old, new in pairs:
            if text.count(old) != 1:
                raise ValueError(f"REPLACE's {old!r} occurs {text.count(old)} times in the "
                                 f"solution's {name}, not once")
            text = text.replace(old, new)
        edits.append((start, end, text.split("\n")))

    def replace(old: ast.stmt, new: ast.stmt) -> None:
        (start, end), (new_start, new_end) = _span(old), _span(new)
        edits.append((start, end, wrong_lines[new_start - 1:new_end]))

    for name, node in _replaced(wrong_tree).items():
        if name not in targets:
            raise ValueError(f"the wrong answer defines {name!r}, which the solution does not")
        old = targets[name]
        if isinstance(node, ast.ClassDef) and isinstance(old, ast.ClassDef):
            methods = _functions(old.body)
            for method_name, method in _functions(node.body).items():
                if method_name not in methods:
                    raise ValueError(f"{name}.{method_name} is not a method of the solution's "
                                     f"{name}")
                replace(methods[method_name], method)
        else:
            replace(old, node)
    if not edits:
        raise ValueError("the wrong answer defines no function or class to put in the solution, "
                         "and no REPLACE")
    imports = [line for node in wrong_tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
               for line in wrong_lines[node.lineno - 1:node.end_lineno]]
    last_import = max((n.end_lineno for n in solution_tree.body
                       if isinstance(n, (ast.Import, ast.ImportFrom))), default=0)
    if imports:
        edits.append((last_import + 1, last_import, imports))  # an insertion: nothing removed
    for start, end, new in sorted(edits, key=lambda e: e[0], reverse=True):
        lines[start - 1:end] = new
    return "\n".join(lines) + "\n"


def processes_under(folder: Path) -> list[str]:
    """Live processes whose working directory or command line is inside ``folder`` (Linux)."""
    folder_text, found = str(folder), []
    for pid in live_processes():
        cwd, command = working_directory(pid), command_line(pid)
        if pid == os.getpid() or cwd is None or not command:  # this one, or gone since
            continue
        if cwd.startswith(folder_text) or folder_text in command:
            found.append(f"{pid}: {command.strip()[:120]}")
    return found
