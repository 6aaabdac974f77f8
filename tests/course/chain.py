"""The chain of scripts: each lesson's main script is an earlier one plus what the lesson teaches.

    python tests/course/chain.py            # the table: lines each step changes
    python tests/course/chain.py --write    # regenerate the diffs shown in the READMEs
    python tests/course/chain.py --check    # exit 1 when a README's diff is stale

The course manifest (``course/manifest.py``) names each step's predecessor (``builds_on``). Each
step's README shows the unified diff from its predecessor between two markers; the diff is
generated from the files, never typed, and ``tests/test_chain.py`` fails when it is stale, when a
step changes more than ``MAX_CHANGED_LINES`` lines, or when a step redefines what the running
example (``lessons/gpt``) already defines.

A *changed line* is a row of a side-by-side diff that differs: a line added, removed or
replaced, counted once; blank lines are not counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `course` and `harness` importable
    ROOT = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "lessons")]

from course.manifest import COURSE, Lesson, Script  # noqa: E402
from course.marked import Marked  # noqa: E402
from harness.exercises import LESSONS_DIR  # noqa: E402

MAX_CHANGED_LINES = 60
MAX_SCRIPT_LINES = 180  # a step, whole, is read in one sitting
CONTEXT_LINES = 2

MARKED = Marked("chain-diff", "the files", "python tests/course/chain.py --write")


@dataclasses.dataclass(frozen=True)
class Step:
    lesson: Lesson
    script: Script

    @property
    def name(self) -> str:
        return f"{self.lesson.folder}/{self.script.path}"

    @property
    def path(self) -> Path:
        return LESSONS_DIR / self.name

    @property
    def previous(self) -> Path:
        return LESSONS_DIR / self.script.builds_on

    @property
    def limit(self) -> int:
        """How many lines this step may change: the course's limit, or the manifest's own."""
        return self.script.max_changed or MAX_CHANGED_LINES

    @property
    def max_lines(self) -> int:
        """How long this step may be: the course's limit, or the manifest's own."""
        return self.script.max_lines or MAX_SCRIPT_LINES

    @property
    def readme(self) -> Path:
        return LESSONS_DIR / self.lesson.folder / "README.md"


@dataclasses.dataclass(frozen=True)
class Counts:
    added: int
    removed: int
    changed: int  # rows of a side-by-side diff: a replaced line counts once


def steps() -> list[Step]:
    """Every script of the course that builds on another, in course order."""
    return [Step(lesson, script) for lesson in COURSE for script in lesson.scripts
            if script.builds_on]


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def count(step: Step) -> Counts:
    old, new = _lines(step.previous), _lines(step.path)
    added = removed = changed = 0
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        gone = sum(1 for line in old[i1:i2] if line.strip())
        came = sum(1 for line in new[j1:j2] if line.strip())
        removed, added, changed = removed + gone, added + came, changed + max(gone, came)
    return Counts(added, removed, changed)


def diff(step: Step) -> str:
    """The unified diff from the predecessor to this step, paths from the repository root."""
    lines = difflib.unified_diff(
        _lines(step.previous), _lines(step.path), lineterm="", n=CONTEXT_LINES,
        fromfile=f"lessons/{step.script.builds_on}", tofile=f"lessons/{step.name}")
    return "\n".join(lines) + "\n"


def block(step: Step) -> str:
    """What the README shows between (and including) the markers: the diff, collapsed (one click
    opens it), so that the lesson's text reads on around it."""
    counts = count(step)
    summary = (f"The diff: <code>lessons/{step.name}</code> against "
               f"<code>lessons/{step.script.builds_on}</code> ({counts.added} lines added, "
               f"{counts.removed} removed)")
    return MARKED.wrap(step.name, f"<details markdown>\n<summary>{summary}</summary>\n\n"
                                  f"```diff\n{diff(step)}```\n\n</details>")


def stale(step: Step) -> str | None:
    """Why ``step``'s README does not show its current diff, or None when it does."""
    readme = f"lessons/{step.lesson.folder}/README.md"
    shown = MARKED.shown(step.readme.read_text(encoding="utf-8")).get(step.name)
    if shown is None:
        return MARKED.missing(readme, step.name, "where the diff belongs")
    if shown != block(step):
        return f"{readme} shows an old diff of {step.name}: run `{MARKED.command}`"
    return None


def write(step: Step) -> bool:
    """Put the current diff into the README's marked block; True when the file changed."""
    if step.name not in MARKED.shown(step.readme.read_text(encoding="utf-8")):
        raise SystemExit(stale(step))
    return MARKED.replace(step.readme, step.name, block(step))


def table() -> str:
    rows = ["| step | builds on | lines (limit) | added | removed | changed lines (limit) |",
            "|---|---|---|---|---|---|"]
    for step in steps():
        c = count(step)
        rows.append(f"| `{step.name}` | `{step.script.builds_on}` | {len(_lines(step.path))} "
                    f"({step.max_lines}) | {c.added} | {c.removed} | {c.changed} ({step.limit}) |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help="regenerate the README diffs")
    action.add_argument("--check", action="store_true", help="exit 1 when a README is stale")
    args = parser.parse_args(argv)
    print(table())
    print(f"\n(changed lines: rows of a side-by-side diff that differ, blank lines not counted; "
          f"the course's limit is {MAX_CHANGED_LINES} per step unless the manifest gives a step "
          "its own, with its reason)")
    if args.write:
        for step in steps():
            if write(step):
                print(f"updated the diff of {step.name} in lessons/{step.lesson.folder}/README.md")
    if args.check:
        problems = [why for step in steps() if (why := stale(step))]
        print("\n".join(problems) or "every README shows its current diff")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
