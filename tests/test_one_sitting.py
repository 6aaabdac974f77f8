"""A lesson is read in one sitting: its main path fits the limit, and what the graders check is
listed from the graders, collapsed, never kept by hand.

tests/course/words.py counts the main path (the README without its collapsed blocks);
tests/course/proofs.py writes each README's list of tests from the tests' own docstrings.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from course import proofs, words
from course.manifest import COURSE, Lesson
from harness.exercises import REPO_ROOT


# Parametrised by folder name: other test files read every item's "lesson" parameter as a string.
@pytest.mark.parametrize("folder", [lesson.folder for lesson in COURSE])
def test_the_main_path_fits_one_sitting(folder):
    """Each lesson's main path is at most 6,000 words, or the limit the manifest gives it."""
    lesson = next(lesson for lesson in COURSE if lesson.folder == folder)
    _, main = words.words(lesson)
    assert main <= words.limit(lesson), (
        f"lessons/{lesson.folder}/README.md has {main:,} words outside its collapsed blocks; the "
        f"limit is {words.limit(lesson):,}: cut repetition, or move depth into <details> blocks")


def test_the_main_path_leaves_out_collapsed_blocks_and_comments():
    """The counter drops nested <details> blocks and comments, and keeps the text around them."""
    text = ("one two\n<details markdown>\n<summary>s</summary>\nthree\n<details>\nfour\n"
            "</details>\nfive\n</details>\nsix\n<!-- a\nb -->\nseven\n")
    assert words.main_path(text).split() == ["one", "two", "six", "seven"]
    with pytest.raises(ValueError, match="never closed"):
        words.main_path("<details>\nopen")


def test_every_readme_lists_its_tests_as_the_tests_say():
    """`proofs.py --check` passes: every lesson test has a one-line summary, every list is
    current (run in its own process: it collects the lessons' tests with pytest)."""
    run = subprocess.run([sys.executable, "tests/course/proofs.py", "--check"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


LESSON = Lesson("99_example", "Example", {"task99_1": "first", "task99_2": "second, third"}, ())


def _test(name, summary, tasks=(), cases=1, gpu_cases=0):
    return proofs.Test(file="test_99.py", name=name, summary=summary, tasks=list(tasks),
                       cases=cases, gpu_cases=gpu_cases, folder=LESSON.folder)


def test_the_list_puts_each_test_under_each_of_its_tasks_in_course_order():
    """A test of two tasks is listed under both, in the manifest's order; one of no task goes
    under "Beyond the tasks"; GPU cases are labelled."""
    tests = [_test("test_b", "B is checked.", ["task99_2", "task99_1"]),
             _test("test_a", "A is checked.", ["task99_1"], cases=2, gpu_cases=1),
             _test("test_s", "The script runs.", cases=1, gpu_cases=1)]
    text = proofs.block(LESSON, tests)
    first, second, beyond = (text.index(f"**{heading}**")
                             for heading in ("task99_1", "task99_2", "Beyond the tasks"))
    assert first < second < beyond
    assert text.count("B is checked.") == 2
    assert "A is checked. *(also on a GPU)*" in text[first:second]
    assert "The script runs. *(needs a GPU)*" in text[beyond:]
    assert "`second`, `third`" in text and "3 tests" in text
    assert text.startswith("<!-- test-list 99_example:") and text.endswith(proofs.MARKED.end)


def test_a_test_without_a_summary_or_with_a_long_one_is_named():
    """The check names the test that has no docstring, and the one whose summary runs long."""
    found = proofs.problems(COURSE[0], [
        _test("test_bare", ""), _test("test_long", "x" * (proofs.MAX_SUMMARY + 1))])
    assert any("test_bare has no docstring" in why for why in found), found
    assert any("test_long: the docstring's first paragraph" in why for why in found), found


def test_a_stale_list_is_caught(tmp_path, monkeypatch):
    """A list one character off is stale; a README without the markers says where they go."""
    lesson, tests = COURSE[0], [_test("test_a", "A is checked.", ["task0_1"])]
    readme = tmp_path / "README.md"
    monkeypatch.setattr(proofs, "readme", lambda _: readme)
    readme.write_text("text\n" + proofs.block(lesson, tests).replace("A is", "A  is") + "\n")
    assert "lists its tests as they were" in proofs.problems(lesson, tests)[0]
    assert proofs.write(lesson, tests) and proofs.problems(lesson, tests) == []
    readme.write_text("no block at all\n")
    assert 'under its heading "What the tests prove"' in proofs.problems(lesson, tests)[0]


def test_the_summary_is_the_docstrings_first_paragraph_on_one_line():
    def example():
        """First line
        goes on.

        Details a reader opens the file for."""

    assert proofs.summary(example) == "First line goes on."
