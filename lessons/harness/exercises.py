"""Which file is graded, and how it is loaded.

Tests never ``import exercises``: two lessons may both have an ``exercises.py``, and the graded
copy is either the learner's (``lessons/NN_x/``) or the reference answer (``solutions/NN_x/``).
The choice travels in the environment variable ``COURSE_SOLUTIONS`` so that it reaches every
process a test starts: rank workers, ``torchrun`` children, plain subprocesses.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import re
import sys
import textwrap
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[2]
LESSONS_DIR = REPO_ROOT / "lessons"
SOLUTIONS_DIR = REPO_ROOT / "solutions"

SOLUTIONS_ENV = "COURSE_SOLUTIONS"
STRICT_ENV = "COURSE_STRICT"

# A stub raises NotImplementedError("task3_2: what to do"); the id is how tests are selected.
TASK_ID = re.compile(r"\b(task\d+_\d+)\b")
TASK_MARK = re.compile(r"^task\d+_\d+$")  # a test's marker: @pytest.mark.task3_2
STUB_TASK = re.compile(r'NotImplementedError\(\s*f?["\'](task\d+_\d+):')

_loaded: dict[Path, ModuleType] = {}


def tasks_of(lesson: str) -> list[str]:
    """Task ids, in order, from the stubs of a lesson's exercise files: the stubs are where a
    task is defined (the course manifest, ``tests/course/manifest.py``, is checked against them)."""
    found: list[str] = []
    for path in sorted((LESSONS_DIR / lesson).glob("exercises*.py")):
        for task in STUB_TASK.findall(path.read_text()):
            if task not in found:
                found.append(task)
    return found


def exercise_files(lesson: str) -> list[str]:
    return sorted(p.name for p in (LESSONS_DIR / lesson).glob("exercises*.py"))


GRADER_FILES = ("test_*.py", "conftest.py", "common.py")  # a lesson's grader and what it shares


def grader_files(folder: Path) -> list[Path]:
    """A lesson folder's test code: its test files, its conftest.py, and common.py (what they
    share, imported as ``lessonNN.common``)."""
    return sorted(path for pattern in GRADER_FILES for path in folder.glob(pattern))


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def solutions_mode() -> bool:
    """True when the reference solutions are graded instead of the learner's files."""
    return _flag(SOLUTIONS_ENV)


def strict_mode() -> bool:
    """True when an untouched stub must fail instead of being skipped as not attempted."""
    return _flag(STRICT_ENV)


def lesson_names() -> list[str]:
    """The lesson folders, in course order: ``00_single_gpu``, ``01_data_parallel``, ..."""
    return sorted(p.name for p in LESSONS_DIR.iterdir() if re.match(r"\d\d_", p.name))


def exercise_path(lesson: str, name: str = "exercises") -> Path:
    """The file that is graded for ``lesson``: ``lessons/<lesson>/<name>.py`` or its solution."""
    root = SOLUTIONS_DIR if solutions_mode() else LESSONS_DIR
    path = root / lesson / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"no exercise file {path.relative_to(REPO_ROOT)}")
    return path


def load_path(path: str | os.PathLike) -> ModuleType:
    """Import a Python file by path, once per process, under a name unique to that path."""
    path = Path(path).resolve()
    if path in _loaded:
        return _loaded[path]
    rel = path.relative_to(REPO_ROOT).with_suffix("")
    module_name = "course_" + "_".join(rel.parts)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    # Registered before running so that pickling (by reference) and dataclasses work.
    sys.modules[module_name] = module
    # As when Python runs the file: its folder first on sys.path while it executes, so that a
    # script finds the modules beside it by name (lesson 09's training_state).
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))  # the first occurrence: the one inserted above
    _loaded[path] = module
    return module


def load_exercise(lesson: str, name: str = "exercises") -> ModuleType:
    """The graded module of ``lesson``: the learner's file, or the solution in solutions mode."""
    return load_path(exercise_path(lesson, name))


def load_lesson_module(lesson: str, name: str) -> ModuleType:
    """A lesson's own script (``train.py`` ...), which is the same in both modes."""
    return load_path(LESSONS_DIR / lesson / f"{name}.py")


def task_of(exc: BaseException) -> str | None:
    """The task id of an untouched stub's NotImplementedError, else None."""
    if not isinstance(exc, NotImplementedError):
        return None
    match = TASK_ID.search(str(exc))
    return match.group(1) if match else None


def raise_if_untouched(*functions) -> None:
    """Raise the stub's own NotImplementedError when one of ``functions`` is still untouched.

    For a test that would otherwise start something costly (ranks, a ``torchrun`` launch) only
    to find the stub: the test is then reported as not attempted at once. Reads the source,
    never calls the functions, so a written answer has no side effect here.
    """
    for function in functions:
        message = stub_message(ast.parse(textwrap.dedent(inspect.getsource(function))).body[0])
        if message is not None and TASK_ID.search(message):
            raise NotImplementedError(message)


def stub_message(function: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The message of ``raise NotImplementedError("...")`` when that (after the docstring) is
    all the function's body holds, else None: how a stub is told from an answer by its source."""
    body = function.body[1:] if ast.get_docstring(function) is not None else function.body
    if len(body) != 1 or not isinstance(body[0], ast.Raise):
        return None
    call = body[0].exc
    if (isinstance(call, ast.Call) and getattr(call.func, "id", "") == "NotImplementedError"
            and call.args and isinstance(call.args[0], ast.Constant)):
        return str(call.args[0].value)
    return None
