"""Course integrity: every lesson is complete, every solution passes, every stub is caught.

These run the lessons' own tests in subprocesses (so the graded mode is clean each time); they
are for CI and teachers, not part of a learner's default ``pytest`` run.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from course.manifest import COURSE
from course.manifest import lesson as course_lesson
from course.selfcheck import (
    RUN_TIMEOUT,
    run_lesson_tests,
    whole_course_outcomes,
)
from harness.exercises import (
    LESSONS_DIR,
    REPO_ROOT,
    SOLUTIONS_DIR,
    TASK_ID,
    exercise_files,
    grader_files,
    lesson_names,
    load_path,
    stub_message,
    tasks_of,
)
from harness.grading import HARDWARE_SKIP_PREFIX, marked_tasks

LESSONS = lesson_names()


def test_there_are_lessons():
    assert LESSONS[:1] == ["00_single_gpu"]


def test_the_manifest_lists_every_lesson_in_order():
    assert [entry.folder for entry in COURSE] == LESSONS, (
        "tests/course/manifest.py must list every lesson folder, in order")


@pytest.mark.parametrize("lesson", LESSONS)
def test_lesson_is_complete(lesson):
    entry = course_lesson(lesson)
    folder = LESSONS_DIR / lesson
    page = REPO_ROOT / "docs" / "lessons" / f"{lesson}.md"
    required = [folder / "README.md", folder / f"test_{lesson}.py", folder / "walkthrough.py",
                page]
    missing = [str(p.relative_to(REPO_ROOT)) for p in required if not p.is_file()]
    assert not missing, f"{lesson} lacks {missing}"
    assert exercise_files(lesson), f"{lesson} has no exercises*.py"
    for name in exercise_files(lesson):
        assert (SOLUTIONS_DIR / lesson / name).is_file(), f"solutions/{lesson}/{name} is missing"
    tasks = tasks_of(lesson)
    assert tasks == list(entry.tasks), (
        f"the stubs raise {tasks}; tests/course/manifest.py lists {list(entry.tasks)}")
    assert all(t.startswith(f"task{entry.number}_") for t in tasks), tasks
    readme = (folder / "README.md").read_text()
    tests = "".join(path.read_text() for path in sorted(folder.glob("test_*.py")))
    for task in tasks:
        assert re.search(rf"^### {task}: `", readme, re.M), (
            f"README has no heading for {task}: give it ### {task}: `function(args)`, then the "
            f"task in a few sentences, its command and its hint")
        assert re.search(rf"<summary>[^<]*\b{task}\b", readme), f"README has no hint for {task}"
        assert f"pytest lessons/{lesson} -m {task}" in readme, f"README: no command for {task}"
        assert f"mark.{task}" in tests, f"no test carries the {task} marker"
    nav = (REPO_ROOT / "mkdocs.yml").read_text()
    assert f'"{lesson[:2]} · {entry.title}": lessons/{lesson}.md' in nav, (
        f"mkdocs.yml's nav needs the line: \"{lesson[:2]} · {entry.title}\": lessons/{lesson}.md")


@pytest.mark.parametrize("lesson", LESSONS)
def test_the_docs_page_shows_every_script_and_every_reference_answer(lesson):
    entry = course_lesson(lesson)
    page = (REPO_ROOT / "docs" / "lessons" / f"{lesson}.md").read_text()
    for script in entry.scripts:
        assert f'--8<-- "lessons/{lesson}/{script.path}"' in page, (
            f"docs/lessons/{lesson}.md does not include lessons/{lesson}/{script.path}")
    for task in entry.tasks:
        for snippet in entry.snippets(task):
            assert f'--8<-- "solutions/{lesson}/exercises.py:{snippet}"' in page, (
                f"docs/lessons/{lesson}.md does not show the answer to {task} ({snippet})")
            source = (SOLUTIONS_DIR / lesson / "exercises.py").read_text()
            assert f"# --8<-- [start:{snippet}]" in source, (
                f"solutions/{lesson}/exercises.py has no snippet section {snippet!r}")


def _public_api(path: Path) -> dict[str, str]:
    module = load_path(path)
    api = {}
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj) or inspect.isclass(obj):
            api[name] = f"{inspect.signature(obj)} | {inspect.getdoc(obj)}"
    return api


def clauses_of(lesson: str) -> tuple[dict | None, set[str]]:
    """The CLAUSES (task -> {clause: [test names]}) of the lesson's test files, merged (each
    task file lists its own tasks'), and the names of the tests those files define."""
    clauses, tests = None, set()
    for path in sorted((LESSONS_DIR / lesson).glob("test_*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                    getattr(target, "id", None) == "CLAUSES" for target in node.targets):
                mine = ast.literal_eval(node.value)
                clauses = clauses or {}
                twice = sorted(set(clauses) & set(mine))
                assert not twice, f"lessons/{lesson}: CLAUSES of {twice} given twice ({path.name})"
                clauses.update(mine)
        mine = {node.name for node in tree.body
                if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
        assert not mine & tests, (f"lessons/{lesson}: {sorted(mine & tests)} defined in two test "
                                  f"files; CLAUSES names tests by name, so each name once")
        tests |= mine
    return clauses, tests


@pytest.mark.parametrize("lesson", LESSONS)
def test_every_task_lists_its_clauses_and_the_tests_that_hold_each(lesson):
    """Each task's contract, clause by clause, with the tests that fail when only that clause
    is broken: a clause nobody tests is a wrong answer that passes. A clause only a GPU can
    show says so ("not testable on CPU: why") instead of naming tests."""
    clauses, tests = clauses_of(lesson)
    assert clauses is not None, f"lessons/{lesson}: no test file has CLAUSES"
    assert sorted(clauses) == sorted(tasks_of(lesson)), (
        f"CLAUSES lists {sorted(clauses)}; the lesson's tasks are {tasks_of(lesson)}")
    for task, contract in clauses.items():
        assert any(isinstance(names, list) for names in contract.values()), (
            f"{task}: no clause with a test")
        for clause, names in contract.items():
            if isinstance(names, str):
                assert names.startswith("not testable on CPU: "), (
                    f"{task}, {clause!r}: name its tests, or say 'not testable on CPU: why'")
                continue
            assert names, f"{task}: no test holds the clause {clause!r}"
            unknown = [name for name in names if name not in tests]
            assert not unknown, f"{task}, {clause!r}: no test function {unknown}"


MAX_TEST_FILE_LINES = 800  # a task's tests, read alone in one sitting


@pytest.mark.parametrize("lesson", LESSONS)
def test_each_lesson_test_file_can_be_read_alone(lesson):
    """Each task's tests in a file of their own size: no lesson test file, nor what they share
    (conftest.py, common.py), over MAX_TEST_FILE_LINES lines."""
    folder = LESSONS_DIR / lesson
    long = {path.name: lines for path in grader_files(folder)
            if (lines := len(path.read_text().splitlines())) > MAX_TEST_FILE_LINES}
    assert not long, (f"lessons/{lesson}: {long} lines; split the file by task (test_NN_K_topic.py)"
                      f", what several files share in common.py or conftest.py")


@pytest.mark.parametrize("lesson", LESSONS)
def test_stubs_and_solutions_expose_the_same_names_and_signatures(lesson):
    for name in exercise_files(lesson):
        stub = _public_api(LESSONS_DIR / lesson / name)
        solution = _public_api(SOLUTIONS_DIR / lesson / name)
        assert sorted(stub) == sorted(solution), f"{lesson}/{name}: public names differ"
        for item in stub:
            assert stub[item] == solution[item], (
                f"{lesson}/{name}: {item} differs between stub and solution "
                f"(signature or docstring):\n  stub:     {stub[item][:200]}\n"
                f"  solution: {solution[item][:200]}"
            )


STUB_MESSAGE = re.compile(r"^task\d+_\d+:")
# Words for the learner's copy only: a reference answer has nothing left to fill in.
LEARNER_ONLY = re.compile(r"(?i)\b(todo|fill (?:it |this |them )?in|your code|until you do|"
                          r"not attempted)\b")


def _stubbed_bodies_blanked(tree: ast.Module, names: set[str] | None = None) -> set[str]:
    """Blank (keep the docstring, replace the rest by ``pass``) the body of each function that
    is a task stub, or, given ``names``, of each function with one of those qualified names.
    Returns the qualified names blanked."""
    blanked = set()

    def is_stub(function) -> bool:
        message = stub_message(function)
        return message is not None and bool(STUB_MESSAGE.match(message))

    def visit(node, prefix: str) -> None:
        for child in node.body:
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                if (is_stub(child) if names is None else name in names):
                    docstring = child.body[:1] if ast.get_docstring(child) is not None else []
                    child.body = [*docstring, ast.Pass()]
                    blanked.add(name)

    visit(tree, "")
    return blanked


@pytest.mark.parametrize("lesson", LESSONS)
def test_stub_and_solution_differ_only_in_the_task_bodies(lesson):
    """By syntax tree: the learner's file is the solution with each task's body replaced by its
    ``raise NotImplementedError("taskN_M: ...")``, and nothing else."""
    for name in exercise_files(lesson):
        stub = ast.parse((LESSONS_DIR / lesson / name).read_text())
        solution_source = (SOLUTIONS_DIR / lesson / name).read_text()
        solution = ast.parse(solution_source)
        stubbed = _stubbed_bodies_blanked(stub)
        assert stubbed, f"lessons/{lesson}/{name} has no task stubs"
        _stubbed_bodies_blanked(solution, stubbed)
        if ast.dump(stub) != ast.dump(solution):
            for a, b in zip(ast.walk(stub), ast.walk(solution), strict=False):
                if isinstance(a, ast.stmt) and ast.dump(a) != ast.dump(b) and not any(
                        isinstance(c, ast.stmt) for c in ast.iter_child_nodes(a)):
                    raise AssertionError(
                        f"{lesson}/{name}: the stub and the solution differ outside the task "
                        f"bodies ({sorted(stubbed)}), first at:\n  stub:     "
                        f"{ast.unparse(a)[:160]}\n  solution: {ast.unparse(b)[:160]}")
            raise AssertionError(f"{lesson}/{name}: stub and solution differ outside the tasks")
        wording = LEARNER_ONLY.findall(solution_source)
        assert not wording, f"solutions/{lesson}/{name} speaks to a learner: {wording}"


@pytest.mark.timeout(RUN_TIMEOUT)
@pytest.mark.parametrize("lesson", LESSONS)
def test_solutions_pass_with_only_hardware_skips(lesson, tmp_path):
    outcomes = whole_course_outcomes(lesson, "solutions", tmp_path)
    bad = {node: result for node, result in outcomes.items()
           if result[0] in ("failure", "error")
           or (result[0] == "skipped" and HARDWARE_SKIP_PREFIX not in result[1])}
    assert not bad, f"solutions of {lesson} do not pass cleanly: {bad}"


@pytest.mark.timeout(RUN_TIMEOUT)
@pytest.mark.parametrize("lesson", LESSONS)
def test_every_untouched_stub_fails_in_strict_mode(lesson, tmp_path):
    tasks = tasks_of(lesson)
    outcomes = run_lesson_tests(lesson, tmp_path, "-m", " or ".join(tasks), COURSE_STRICT="1")
    passed = [node for node, (outcome, _) in outcomes.items() if outcome == "passed"]
    assert not passed, f"these task tests pass on the untouched stubs of {lesson}: {passed}"
    soft_skips = [node for node, (outcome, message) in outcomes.items()
                  if outcome == "skipped" and HARDWARE_SKIP_PREFIX not in message]
    assert not soft_skips, f"skipped for a reason other than hardware: {soft_skips}"
    assert any(outcome == "failure" for outcome, _ in outcomes.values())


@pytest.mark.timeout(RUN_TIMEOUT * 3)  # all lessons, one after the other
def test_learner_mode_is_green_on_the_untouched_course(tmp_path):
    """A fresh clone's ``pytest``: passes and not-attempted skips (and hardware skips) only."""
    for lesson in LESSONS:
        outcomes = whole_course_outcomes(lesson, "learner", tmp_path)
        bad = {node: result for node, result in outcomes.items()
               if result[0] in ("failure", "error")
               or (result[0] == "skipped" and not (
                   result[1].startswith(HARDWARE_SKIP_PREFIX) or "not attempted yet" in result[1]))}
        assert not bad, f"{lesson} is not green in learner mode: {bad}"


@pytest.mark.parametrize("lesson", LESSONS)
def test_task_ids_match_between_stubs_and_lesson(lesson):
    """Every task id a test marks exists as a stub, so -m selects real work (and the grading
    plugin registers exactly the stubs' ids as markers: it reads them from the same marks)."""
    marked = set(marked_tasks(lesson))
    assert marked == set(tasks_of(lesson)), (
        f"markers {sorted(marked)} vs stubs {tasks_of(lesson)}"
    )
    assert all(TASK_ID.fullmatch(t) for t in marked)


# README commands CI does not run as written, and why.
NOT_RUN_BY_CI = {
    "git clone": "CI starts from a clone",
    "python3 -m venv .venv": ".ci/venv builds the same clean venv, cached by requirements' hash",
    "pip install -r requirements.txt": ".ci/venv installs requirements.txt into that venv",
    "mkdocs serve": "CI builds the same site with mkdocs build --strict",
    "git checkout --": "resets a learner's exercise; a fresh clone has nothing to reset",
    "diff lessons/": ("compares two files (an exercise with its answer, or two steps of the "
                      "chain: tests/test_chain.py checks the diffs the READMEs show)"),
    "bash .ci/gpu-checks": "needs a GPU; run it on a GPU machine",
}


def readme_commands() -> list[str]:
    """Every command line in the README's bash blocks, without comments and prompts."""
    readme = (REPO_ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S):
        for line in block.splitlines():
            if line.lstrip().startswith("#"):  # a comment line: an option, not a command run
                continue
            command = line.split(" #", 1)[0].strip()
            if command:
                commands.extend(part.strip() for part in command.split("&&"))
    return commands


def test_ci_runs_every_readme_command():
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    commands = [c for c in readme_commands() if not c.startswith("cd ")
                and not c.startswith("source ")]
    missing = [c for c in commands if c not in ci
               and not any(c.startswith(prefix) for prefix in NOT_RUN_BY_CI)]
    assert commands and not missing, f"README commands .ci/run does not run: {missing}"


# ---------------------------------------------------------------- one spelling per flag
# A flag means one thing and is spelt one way in every script, lab and text of the course; the
# left-hand spellings were each in use once, beside the right-hand ones.
FLAG_SPELLINGS = {"--batch": "--batch-size", "--batch_size": "--batch-size",
                  "--iters": "--steps", "--iterations": "--steps", "--num-steps": "--steps",
                  "--depth": "--blocks", "--layers": "--blocks", "--n-layers": "--blocks"}


def _flags_defined(path: Path) -> set[str]:
    """Every ``--flag`` that ``path`` passes to an ``add_argument`` call."""
    return {arg.value for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
            for arg in node.args
            if isinstance(arg, ast.Constant) and str(arg.value).startswith("--")}


_FLAG_IN_TEXT = re.compile(r"(?<![\w-])(--[a-z][a-z_-]*)(?![\w-])")


def test_every_flag_is_spelt_one_way():
    repo = LESSONS_DIR.parent
    found = []
    for path in sorted([*repo.glob("lessons/**/*.py"), *repo.glob("tests/**/*.py"),
                        *repo.glob("solutions/**/*.py")]):
        for flag in _flags_defined(path) & FLAG_SPELLINGS.keys():
            found.append(f"{path.relative_to(repo)} defines {flag}")
    for path in sorted([*repo.glob("lessons/**/*.md"), *repo.glob("docs/**/*.md"),
                        repo / "README.md"]):
        for flag in set(_FLAG_IN_TEXT.findall(path.read_text(encoding="utf-8"))):
            if flag in FLAG_SPELLINGS:
                found.append(f"{path.relative_to(repo)} writes {flag}")
    assert not found, ("one spelling per flag: " + "; ".join(
        f"{where} (write {FLAG_SPELLINGS[where.split()[-1]]})" for where in found))


def test_the_flag_check_sees_a_definition(tmp_path):
    script = tmp_path / "s.py"
    script.write_text('import argparse\np = argparse.ArgumentParser()\n'
                      'p.add_argument("--batch", type=int)\np.add_argument("-v", "--iters")\n')
    assert _flags_defined(script) == {"--batch", "--iters"}
    assert _FLAG_IN_TEXT.findall("run it with --batch 4, not --batch-size") == [
        "--batch", "--batch-size"]
