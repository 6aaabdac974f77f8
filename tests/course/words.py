"""How long each lesson's main path is: the words a learner reads top to bottom.

    python tests/course/words.py        # each lesson's words: the README, and its main path

The main path is the README as ``wc -w`` counts it, without what a learner opens only by choice:
the collapsed blocks (``<details>`` ... ``</details>``, the chain's diffs and the list of tests
among them). A lesson is read in one sitting: its main path is at most ``MAX_WORDS`` words,
unless the manifest gives it its own limit with the reason (``tests/test_docs.py`` checks).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `course` and `harness` importable
    ROOT = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "lessons")]

from course.manifest import COURSE, Lesson  # noqa: E402
from harness.exercises import LESSONS_DIR  # noqa: E402

MAX_WORDS = 6000


def main_path(text: str) -> str:
    """``text`` without its collapsed blocks (nested ones included) and HTML comments."""
    kept, depth, in_comment = [], 0, False
    for line in text.splitlines():
        stripped = line.strip()
        if in_comment or stripped.startswith("<!--"):
            in_comment = "-->" not in stripped
            continue
        if stripped.startswith("<details"):
            depth += 1
        elif depth and stripped.startswith("</details>"):
            depth -= 1
        elif depth == 0:
            kept.append(line)
    if depth:
        raise ValueError("a <details> block is never closed")
    return "\n".join(kept)


def words(lesson: Lesson) -> tuple[int, int]:
    """(the README's words, its main path's words)."""
    text = (LESSONS_DIR / lesson.folder / "README.md").read_text(encoding="utf-8")
    return len(text.split()), len(main_path(text).split())


def limit(lesson: Lesson) -> int:
    return lesson.max_words or MAX_WORDS


def main() -> int:
    print("| lesson | README | main path (limit) |")
    print("|---|---|---|")
    over = []
    for lesson in COURSE:
        whole, main_words = words(lesson)
        print(f"| {lesson.folder} | {whole:,} | {main_words:,} ({limit(lesson):,}) |")
        if main_words > limit(lesson):
            over.append(lesson.folder)
    if over:
        print(f"\nover the limit: {', '.join(over)}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
