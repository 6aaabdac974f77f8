"""The course runs on exactly what ``pip install -r requirements.txt`` installs.

CI runs these in a clean virtual environment built from requirements.txt alone (.ci/venv), so a
dependency that only a developer's machine has (numpy, once) fails here instead of on every new
learner's first ``pytest``:
- every third-party import in the course comes from a distribution requirements.txt names;
- every module imports in a fresh process;
- every lesson script runs once, the way a learner starts it: at its smallest size, unless a
  lesson test already ran it with the same launcher in this CI run.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from course.manifest import COURSE, Script
from harness.exercises import REPO_ROOT, grader_files
from harness.launch import recorded_launches, start_script

COURSE_FILES = sorted(p for folder in ("lessons", "solutions", "tests")
                      for p in (REPO_ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)
FIRST_PARTY = ({p.name for folder in ("lessons", "tests") for p in (REPO_ROOT / folder).iterdir()
                if (p / "__init__.py").is_file()}  # harness, gpt, course
               | {f"lesson{p.name[:2]}" for p in (REPO_ROOT / "lessons").glob("[0-9][0-9]_*")}
               | {p.stem for p in COURSE_FILES})  # and the course's own files
# Imported only on request, with a clear message when missing; not needed to learn or grade.
OPTIONAL = {"matplotlib": "pipeline_sweep.py --plot (the script says how to install it)"}

# Each lesson script, run once the way a learner starts it, at its smallest size (the manifest
# says how); lesson 04's labs run their fixed version (lesson 04's tests run the bugs).
SCRIPT_RUNS: dict[str, Script] = {f"{entry.folder}/{script.path}": script
                                  for entry in COURSE for script in entry.scripts}
SCRIPTS_AT_ONCE = 3  # most of a launch is importing torch; three overlap well on two cores


def _requirement_names() -> set[str]:
    names = set()
    for line in (REPO_ROOT / "requirements.txt").read_text().splitlines():
        match = re.match(r"\s*([A-Za-z0-9_.-]+)", line.split("#")[0])
        if match:
            names.add(_normal(match.group(1)))
    return names


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imported_top_level_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_requirements_install_every_third_party_import():
    required = _requirement_names()
    distributions = importlib.metadata.packages_distributions()
    unlisted = {}
    for path in COURSE_FILES:
        for module in _imported_top_level_modules(path) - FIRST_PARTY - set(OPTIONAL):
            if module in sys.stdlib_module_names:
                continue
            providers = {_normal(d) for d in distributions.get(module, [])}
            if not providers & required:
                unlisted.setdefault(module, []).append(str(path.relative_to(REPO_ROOT)))
    assert not unlisted, (
        f"imported but not installed by requirements.txt (add them there): {unlisted}")


def test_requirements_include_numpy_which_torch_does_not_install():
    """torch needs numpy for ``.numpy()`` and for the object collectives (``all_gather_object``
    pickles through ``tensor.numpy()``), yet does not install it: without it a lesson 04 lab and
    the doctor crash with "Numpy is not available"."""
    torch_requires = importlib.metadata.requires("torch") or []
    assert not any(_normal(r).startswith("numpy") for r in torch_requires), (
        "torch now installs numpy itself: the requirements line may say so")
    assert "numpy" in _requirement_names()


IMPORT_EVERYTHING = """
import importlib
import sys
from pathlib import Path
sys.path.insert(0, {lessons!r})
from harness.exercises import load_path
for name in {files!r}:
    path = Path(name)
    sys.path.insert(0, str(path.parent))  # as when the file runs as a script
    try:
        if path.parent.name == "gpt":  # the running example is a package: import it as one
            importlib.import_module("gpt" if path.stem == "__init__" else f"gpt.{{path.stem}}")
        else:
            load_path(path)
    except BaseException as error:
        print(f"{{path}}: {{type(error).__name__}}: {{error}}")
        raise SystemExit(1)
    finally:
        sys.path.pop(0)
print("imported", len({files!r}))
"""


def test_every_module_imports_in_a_fresh_process():
    # Walkthroughs run top to bottom when imported (tests/test_docs.py runs them); conftests
    # and the launch probe are not importable modules.
    files = [str(p) for p in COURSE_FILES if p.name not in ("walkthrough.py", "conftest.py")
             and "probes" not in p.parts and "wrong_answers" not in p.parts]
    code = IMPORT_EVERYTHING.format(lessons=str(REPO_ROOT / "lessons"), files=files)
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=180)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"


def test_the_manifest_lists_every_lesson_script():
    lessons = REPO_ROOT / "lessons"
    modules = {f"{entry.folder}/{name}" for entry in COURSE for name in entry.modules}
    test_code = {path for folder in lessons.glob("[0-9][0-9]_*/")
                 for path in grader_files(folder)}
    scripts = {str(p.relative_to(lessons)) for p in lessons.glob("[0-9][0-9]_*/**/*.py")
               if p not in test_code and not p.name.startswith("exercises")
               and p.name != "walkthrough.py" and str(p.relative_to(lessons)) not in modules}
    assert scripts == set(SCRIPT_RUNS), (
        f"add to the manifest (tests/course/manifest.py): {sorted(scripts - set(SCRIPT_RUNS))}; "
        f"gone: {sorted(set(SCRIPT_RUNS) - scripts)}")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_lesson_script_runs_at_its_smallest_size():
    # In CI the lesson tests have just launched many of these scripts the same way (learner
    # and --solutions runs, recorded by harness.launch): each of those has run, and is not
    # started again. Anywhere else every script runs here.
    ran = {(launch["script"], launch["launcher"]) for launch in recorded_launches()
           if launch["returncode"] == 0}
    already = sorted(name for name, script in SCRIPT_RUNS.items()
                     if (f"lessons/{name}", script.launcher) in ran)
    print(f"already run by the lesson tests in this CI run: {already}")
    failures, timings = {}, {}
    pending = [(name, script) for name, script in SCRIPT_RUNS.items() if name not in already]
    while pending:
        batch, pending = pending[:SCRIPTS_AT_ONCE], pending[SCRIPTS_AT_ONCE:]
        started = {name: (time.monotonic(), start_script(
            f"lessons/{name}", *script.smallest, launcher=script.launcher, nproc=script.nproc,
            result=False, check=False, timeout=120)) for name, script in batch}
        for name, (began, launch) in started.items():
            run = launch.result()
            timings[name] = round(time.monotonic() - began, 1)
            if run.returncode != 0:
                failures[name] = run.output[-2500:]
    print(json.dumps(timings, indent=1))
    assert not failures, "\n\n".join(f"== {name} ==\n{out}" for name, out in failures.items())


def test_the_gpu_checks_collect_with_torch_pytest_and_pytest_timeout_alone(tmp_path):
    """The GPU machine's image has torch, pytest and pytest-timeout, not hypothesis, mkdocs or
    jupytext: `pytest lessons -m gpu --solutions` (what .ci/gpu-checks runs) must collect there.
    Those packages are hidden here by modules of the same names that refuse to import (and
    hypothesis's pytest plugin, which its absence would take away, is turned off)."""
    for name in ("hypothesis", "mkdocs", "jupytext", "nbformat"):
        (tmp_path / f"{name}.py").write_text(f"raise ImportError('no {name} on the GPU image')\n")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:hypothesispytest", "lessons", "-m", "gpu",
         "--solutions", "--collect-only", "-q"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert run.returncode == 0, (
        f"the GPU checks do not collect without hypothesis, mkdocs and jupytext:\n"
        f"{run.stdout[-3000:]}\n{run.stderr[-2000:]}")
