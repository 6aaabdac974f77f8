"""What the lessons' tests share (not lesson material; the maintainers' tooling is tests/course).

- ``harness.exercises``: which file is graded (your exercise or the reference solution) and
  loading it by path.
- ``harness.grading``: the pytest plugin: ``--solutions``, "not attempted yet" skips, task markers,
  the progress summary.
- ``harness.hardware``: what this machine has, and skip reasons that say what a check needs.
- ``harness.compare``: tensor comparison whose failure message a learner can act on.
- ``harness.ranks``: run a function on N ranks through a reusable pool of worker processes.
- ``harness.launch``: run a lesson script under the real ``torchrun`` and read its result.
- ``harness.memory``: the bytes of the tensors an object (a model, an optimizer) holds, for
  memory claims that must hold on a CPU too.
- ``harness.collectives``: count the collectives a piece of code calls and the bytes they move.
- ``harness.sweep``: generated inputs (hypothesis), the same examples on every machine.
- ``harness.processes``: the live processes under a folder, and the command lines of processes.

Importing ``harness`` also makes each lesson folder importable by its number: ``lesson07`` is
``lessons/07_pipeline_parallel``, so a lesson's own tool or test helper is imported by what it
is (``from lesson07.simulator import simulate``), though the folders' names start with digits.
Never import a lesson's ``exercises`` this way: ``harness.exercises`` picks the graded copy.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import re
import sys
from pathlib import Path

_LESSONS = Path(__file__).resolve().parents[1]
_LESSON_NAME = re.compile(r"lesson(\d\d)")


class LessonFolders(importlib.abc.MetaPathFinder):
    """``lessonNN`` is the namespace package whose one folder is ``lessons/NN_*``."""

    def find_spec(self, name, path=None, target=None):
        match = _LESSON_NAME.fullmatch(name)
        folders = sorted(_LESSONS.glob(f"{match.group(1)}_*/")) if match else []
        if not folders:
            return None
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(folders[0])]
        return spec


if not any(isinstance(finder, LessonFolders) for finder in sys.meta_path):
    sys.meta_path.append(LessonFolders())
