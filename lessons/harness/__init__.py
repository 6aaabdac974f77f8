"""Shared machinery for the course's tests (not lesson material).

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
- ``harness.pipeline``: run a pipeline schedule on paper: each stage's timeline, deadlocks named,
  the bubble and the activations in flight, and the timeline as an SVG picture.
- ``harness.course``: the course manifest: lessons, their tasks and scripts.
- ``harness.selfcheck``: run the course's own tests from outside, in scratch copies (for
  ``tests/``: solutions pass, stubs and known wrong answers are caught).
- ``check_setup.py``: a script lesson 03's tests run under ``torchrun`` to call the
  graded ``setup`` in real launched processes.
"""
