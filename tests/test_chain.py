"""The chain of scripts: each step is its predecessor plus only what its lesson teaches.

The manifest (tests/course/manifest.py) names each step's predecessor; tests/course/chain.py
computes the diffs. These checks keep the chain honest: the README shows the diff as the files
have it now, no step changes more than the limit, the running example is defined once (in
lessons/gpt) and imported by every step, and a name means one thing within a lesson.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import gpt
import pytest

from course import chain
from course.manifest import COURSE

STEPS = chain.steps()
LESSONS_DIR = chain.LESSONS_DIR


def _ids(steps):
    return [step.name for step in steps]


def test_the_chain_has_its_steps():
    assert [step.name for step in STEPS][:3] == [
        "01_data_parallel/train.py", "02_model_parallel/train.py", "03_ddp/train_ddp.py"]
    assert all(step.script.builds_on == "00_single_gpu/train.py" for step in STEPS[:3])


@pytest.mark.parametrize("step", STEPS, ids=_ids(STEPS))
def test_a_step_builds_on_a_script_of_an_earlier_lesson(step):
    """Or on a script listed before it in its own lesson (lesson 09 takes two steps)."""
    folder, _, script = step.script.builds_on.partition("/")
    earlier = {entry.folder: [s.path for s in entry.scripts] for entry in COURSE
               if entry.number < step.lesson.number}
    own = [s.path for s in step.lesson.scripts]
    earlier[step.lesson.folder] = own[:own.index(step.script.path)]
    assert folder in earlier and script in earlier[folder], (
        f"{step.name} builds on {step.script.builds_on}, which is not a script of the manifest "
        "in an earlier lesson, nor one listed before it in its own")
    assert step.previous.is_file() and step.path.is_file()


@pytest.mark.parametrize("step", STEPS, ids=_ids(STEPS))
def test_the_readme_shows_the_current_diff(step):
    why = chain.stale(step)
    assert why is None, why


@pytest.mark.parametrize("step", STEPS, ids=_ids(STEPS))
def test_a_step_changes_at_most_the_limit(step):
    counts = chain.count(step)
    assert counts.changed <= step.limit, (
        f"{step.name} changes {counts.changed} lines of {step.script.builds_on} "
        f"(+{counts.added} -{counts.removed}); it may change {step.limit}: move what is not "
        "this lesson's point into lessons/gpt/run.py, or give the step its own limit in "
        "tests/course/manifest.py with the reason")


def test_the_count_sees_every_kind_of_change(tmp_path, monkeypatch):
    """A replaced line counts once, an added or removed line once, a blank line not at all."""
    old = tmp_path / "old.py"
    new = tmp_path / "new.py"
    old.write_text("a\nb\nc\n\nd\n")
    new.write_text("a\nB\nc\nx\n\n\ny\nd\n")  # b replaced, x and y added, blank lines added
    step = chain.Step(COURSE[1], COURSE[1].scripts[0])
    monkeypatch.setattr(chain.Step, "previous", property(lambda self: old))
    monkeypatch.setattr(chain.Step, "path", property(lambda self: new))
    counts = chain.count(step)
    assert (counts.added, counts.removed, counts.changed) == (3, 1, 3)


def test_a_stale_readme_is_caught(tmp_path, monkeypatch):
    step = STEPS[0]
    readme = tmp_path / "README.md"
    readme.write_text(chain.block(step).replace("+", "+ ", 1))  # one character off
    monkeypatch.setattr(chain.Step, "readme", property(lambda self: readme))
    assert "old diff" in chain.stale(step)
    readme.write_text("no block at all\n")
    assert "has no chain-diff block" in chain.stale(step)


def _top_level(path: Path) -> dict[str, str]:
    source = path.read_text(encoding="utf-8")
    return {node.name: ast.get_source_segment(source, node)
            for node in ast.parse(source).body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def _imports_from(path: Path, module: str) -> set[str]:
    return {alias.name for node in ast.parse(path.read_text(encoding="utf-8")).body
            if isinstance(node, ast.ImportFrom) and node.module == module for alias in node.names}


CHAIN_FILES = sorted({LESSONS_DIR / s.script.builds_on for s in STEPS} | {s.path for s in STEPS})


@pytest.mark.parametrize("path", CHAIN_FILES, ids=lambda p: str(p.relative_to(LESSONS_DIR)))
def test_every_step_imports_the_running_example_and_its_plumbing(path):
    name = path.relative_to(LESSONS_DIR)
    assert {"GPT", "GPTConfig"} <= _imports_from(path, "gpt"), (
        f"{name} must import the model from lessons/gpt, not define its own")
    used = {node.attr for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "run"}
    assert "run" in _imports_from(path, "gpt") and {
        "evaluate", "record_epoch", "add_common_arguments"} <= used, (
        f"{name} must take the plumbing every run shares (validation, the result record, the "
        "common flags) from lessons/gpt/run.py as run.evaluate, run.record_epoch, ..., not copy "
        "it")


LIMITS = {LESSONS_DIR / s.script.builds_on: chain.MAX_SCRIPT_LINES for s in STEPS} | {
    s.path: s.max_lines for s in STEPS}


@pytest.mark.parametrize("path", CHAIN_FILES, ids=lambda p: str(p.relative_to(LESSONS_DIR)))
def test_a_step_is_short_enough_to_read_in_one_sitting(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= LIMITS[path], (
        f"{path.relative_to(LESSONS_DIR)} has {lines} lines, over {LIMITS[path]}: move what its "
        "lesson does not teach into lessons/gpt/run.py, or give the step its own limit in "
        "tests/course/manifest.py with the reason")


def test_a_step_with_its_own_limit_says_why():
    """A limit of its own is above the course's and has its reason beside it in the manifest:
    a comment naming the number, in the lines just above the step's entry."""
    manifest = Path(__file__).parent / "course" / "manifest.py"
    source = manifest.read_text(encoding="utf-8").splitlines()
    for step in STEPS:
        own = [(step.script.max_changed, chain.MAX_CHANGED_LINES, "changed"),
               (step.script.max_lines, chain.MAX_SCRIPT_LINES, "lines")]
        entry = next(i for i, line in enumerate(source) if f'Script("{step.script.path}"' in line)
        comments = " ".join(line for line in source[max(0, entry - 4):entry]
                            if line.strip().startswith("#"))
        for limit, course_limit, what in own:
            if limit is None:
                continue
            assert limit > course_limit, (
                f"{step.name}: max_{what}={limit} is not above the course's {course_limit}")
            assert re.search(rf"\b{limit}\b", comments), (
                f"{step.name} may have {limit} {what}: say why in a comment naming {limit} just "
                "above its entry in tests/course/manifest.py")


def _plumbing() -> set[str]:
    """What lessons/gpt/run.py defines for every step to import."""
    return {name for name in _top_level(LESSONS_DIR / "gpt" / "run.py") if not name.startswith("_")}


def _task_names(path: Path) -> set[str]:
    """The graded tasks' names, where ``path`` is a lesson's exercises file: a task may share a
    name with the plumbing (lesson 00's task0_1 is choose_device), and its stub must keep it."""
    if path.name != "exercises.py":
        return set()
    entry = next((e for e in COURSE if e.folder == path.parent.name), None)
    return {name.strip() for sections in (entry.tasks.values() if entry else ())
            for name in sections.split(",")}


# Lesson 04's labs each run alone, as one file a learner reads top to bottom, and each carries one
# smaller setup() (a timeout of its own; torch.distributed.nn imported before the group exists)
# that lesson 04's test keeps identical in every lab.
OWN_SETUP = ("04_pitfalls", "labs")


def test_the_running_example_is_defined_once():
    """No lesson file defines what lessons/gpt exports or lessons/gpt/run.py defines: a copy
    would drift from the original."""
    exported = set(gpt.__all__) | _plumbing()
    copies = [f"{path.relative_to(LESSONS_DIR)} defines {name}"
              for path in sorted(LESSONS_DIR.rglob("*.py"))
              if "gpt" not in path.relative_to(LESSONS_DIR).parts[:1]
              for name in (_top_level(path).keys() & exported) - _task_names(path)
              if not (name == "setup" and path.relative_to(LESSONS_DIR).parts[:2] == OWN_SETUP)]
    assert not copies, "import these from lessons/gpt instead: " + "; ".join(copies)


def test_the_reference_choose_device_is_the_one_every_script_uses():
    solution = LESSONS_DIR.parent / "solutions" / "00_single_gpu" / "exercises.py"
    assert _top_level(solution)["choose_device"] == _top_level(
        LESSONS_DIR / "gpt" / "run.py")["choose_device"], (
        "solutions/00_single_gpu/exercises.py's choose_device (task0_1's reference answer) and "
        "lessons/gpt/run.py's (the one every script uses) must be the same code: edit both")


# Each script has its own entry point; lesson 04's labs share theirs and are kept identical by
# lesson 04's own test.
ENTRY_POINTS = {"main", "parse_args"}


@pytest.mark.parametrize("entry", COURSE, ids=[entry.folder for entry in COURSE])
def test_a_name_means_one_thing_within_a_lesson(entry):
    """Two scripts of a lesson that define the same function define the same function, unless
    one is a step of the chain built on the other (directly or through other steps): then their
    difference is the lesson."""
    seen: dict[str, tuple[str, str]] = {}
    clashes = []
    builds_on = {s.path: s.builds_on.partition("/")[2] for s in entry.scripts
                 if s.builds_on and s.builds_on.startswith(f"{entry.folder}/")}
    steps_within = set()  # (step, a step it builds on, directly or through others)
    for step in builds_on:
        earlier = step
        while earlier in builds_on:
            earlier = builds_on[earlier]
            steps_within.add((step, earlier))
    for script in entry.scripts:
        if script.path.startswith("labs/"):
            continue
        for name, source in _top_level(LESSONS_DIR / entry.folder / script.path).items():
            if name in ENTRY_POINTS:
                continue
            first = seen.setdefault(name, (script.path, source))
            if first[1] != source and (script.path, first[0]) not in steps_within:
                clashes.append(f"{name} in {first[0]} and {script.path}")
    assert not clashes, ("same name, different code (make them identical, or rename one): "
                         + "; ".join(clashes))
