"""What the tests prove: each lesson's tests, listed in its README by the task each one grades.

    python tests/course/proofs.py            # each lesson's tests, counted by task
    python tests/course/proofs.py --write    # regenerate the lists the READMEs show
    python tests/course/proofs.py --check    # exit 1 when a list is stale or a test has no summary

The list is never typed: pytest collects the lesson's tests, and each line is the summary of one
test's docstring (its first paragraph), under every task the test is marked with. A test of no
task (a script's run, a sentence of the text) is listed under "Beyond the tasks". So the list
says what the graders check because it is read from them; ``tests/test_proofs.py`` fails when a
README's list is stale or when a test has no summary, or one too long to read as one line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import io
import re
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `course` and `harness` importable
    ROOT = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "lessons")]

from course.manifest import COURSE, Lesson  # noqa: E402
from course.marked import Marked  # noqa: E402
from harness.exercises import LESSONS_DIR, REPO_ROOT  # noqa: E402

MAX_SUMMARY = 320  # characters: a summary reads as one line of the list, not a paragraph

MARKED = Marked("test-list", "the tests' docstrings", "python tests/course/proofs.py --write")
_TASK = re.compile(r"task\d+_\d+")


@dataclasses.dataclass
class Test:
    """One test function, however many cases its parameters make."""

    file: str  # relative to the lesson folder
    name: str
    summary: str  # the first paragraph of its docstring, on one line ("" when it has none)
    tasks: list[str] = dataclasses.field(default_factory=list)
    cases: int = 0
    gpu_cases: int = 0
    folder: str = ""

    @property
    def where(self) -> str:
        return f"lessons/{self.folder}/{self.file}::{self.name}"

    def line(self) -> str:
        gpu = ""
        if self.gpu_cases == self.cases:
            gpu = " *(needs a GPU)*"
        elif self.gpu_cases:
            gpu = " *(also on a GPU)*"
        return f"- {self.summary}{gpu} <small>`{self.name}`</small>"


def summary(function) -> str:
    doc = inspect.getdoc(function) or ""
    return " ".join(doc.split("\n\n")[0].split())


class _Recorder:
    """A pytest plugin that keeps what collection found, one entry per test function."""

    def __init__(self):
        self.tests: dict[tuple[str, str], Test] = {}

    def pytest_collection_finish(self, session):
        for item in session.items:
            path = Path(str(item.path)).resolve()
            folder = path.parent.name
            key = (folder, f"{path.name}::{item.function.__name__}")
            test = self.tests.setdefault(key, Test(
                file=path.name, name=item.function.__name__, summary=summary(item.function),
                folder=folder))
            test.cases += 1
            names = [mark.name for mark in item.iter_markers()]
            test.gpu_cases += "gpu" in names
            for name in names:
                if _TASK.fullmatch(name) and name not in test.tasks:
                    test.tasks.append(name)


def collect(lessons: list[Lesson]) -> dict[str, list[Test]]:
    """lesson folder -> its tests, in the order pytest collects them."""
    recorder = _Recorder()
    paths = [str(LESSONS_DIR / lesson.folder) for lesson in lessons]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        import pytest

        code = pytest.main(["--collect-only", "-q", "--rootdir", str(REPO_ROOT), *paths],
                           plugins=[recorder])
    if code != 0:
        raise SystemExit(f"pytest could not collect the lessons' tests (exit {code}):\n"
                         + out.getvalue()[-3000:])
    found: dict[str, list[Test]] = {lesson.folder: [] for lesson in lessons}
    for (folder, _), test in recorder.tests.items():
        found[folder].append(test)
    return found


def block(lesson: Lesson, tests: list[Test]) -> str:
    """What the README shows between (and including) the markers: every test, by task, collapsed."""
    parts = []
    for task in lesson.tasks:
        graded = [test for test in tests if task in test.tasks]
        what = ", ".join(f"`{name}`" for name in lesson.snippets(task))
        parts.append(f"**{task}** · {what}\n\n" + "\n".join(test.line() for test in graded))
    others = [test for test in tests if not test.tasks]
    if others:
        parts.append("**Beyond the tasks**: the lesson's scripts and what its text says\n\n"
                     + "\n".join(test.line() for test in others))
    summary_line = (f"The lesson's {len(tests)} tests, by the task each grades: one line each, "
                    "the test's own docstring")
    body = "\n\n".join(parts)
    return MARKED.wrap(lesson.folder, f"<details markdown>\n<summary>{summary_line}</summary>"
                                      f"\n\n{body}\n\n</details>")


def readme(lesson: Lesson) -> Path:
    return LESSONS_DIR / lesson.folder / "README.md"


def shown(lesson: Lesson) -> str | None:
    return MARKED.shown(readme(lesson).read_text(encoding="utf-8")).get(lesson.folder)


def docstring_problems(tests: list[Test]) -> list[str]:
    """The tests whose summary the list cannot show: none, or one too long for a line."""
    found = []
    for test in tests:
        if not test.summary:
            found.append(f"{test.where} has no docstring: its first line says what it proves")
        elif len(test.summary) > MAX_SUMMARY:
            found.append(f"{test.where}: the docstring's first paragraph is {len(test.summary)} "
                         f"characters; say what it proves in at most {MAX_SUMMARY}, and put the "
                         "rest after a blank line")
    return found


def _no_list(lesson: Lesson) -> str:
    return MARKED.missing(f"lessons/{lesson.folder}/README.md", lesson.folder,
                          'under its heading "What the tests prove"')


def problems(lesson: Lesson, tests: list[Test]) -> list[str]:
    """Why the README's list is not what the tests say, or why it cannot be made."""
    found = docstring_problems(tests)
    current = shown(lesson)
    if current is None:
        found.append(_no_list(lesson))
    elif not found and current != block(lesson, tests):
        found.append(f"lessons/{lesson.folder}/README.md lists its tests as they were: run "
                     f"`{MARKED.command}`")
    return found


def write(lesson: Lesson, tests: list[Test]) -> bool:
    if shown(lesson) is None:
        raise SystemExit(_no_list(lesson))
    return MARKED.replace(readme(lesson), lesson.folder, block(lesson, tests))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lessons", nargs="*", help="lesson folders (default: every lesson)")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help="regenerate the READMEs' lists")
    action.add_argument("--check", action="store_true", help="exit 1 when a list is stale")
    args = parser.parse_args(argv)
    unknown = set(args.lessons) - {lesson.folder for lesson in COURSE}
    if unknown:
        parser.error(f"no such lesson: {', '.join(sorted(unknown))}")
    lessons = [lesson for lesson in COURSE if not args.lessons or lesson.folder in args.lessons]
    found = collect(lessons)
    print("| lesson | tests | of a task | beyond the tasks | without a summary |")
    print("|---|---|---|---|---|")
    for lesson in lessons:
        tests = found[lesson.folder]
        tasked = sum(1 for test in tests if test.tasks)
        bare = sum(1 for test in tests if not test.summary)
        print(f"| {lesson.folder} | {len(tests)} | {tasked} | {len(tests) - tasked} | {bare} |")
    if args.write:
        for lesson in lessons:
            if not docstring_problems(found[lesson.folder]):
                if write(lesson, found[lesson.folder]):
                    print(f"updated the list of tests in lessons/{lesson.folder}/README.md")
    if args.check or args.write:
        all_problems = [p for lesson in lessons for p in problems(lesson, found[lesson.folder])]
        print("\n".join(all_problems) or "every README lists its tests as they are")
        return 1 if all_problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
