"""What the test files of lesson 04 share: the lesson's name and the doctor's path, the labs as
modules (``lab``), lab 03's true accuracy, the process-group timeout of the task tests, a loss
that checks its arguments' order, and the check that an exercise raised a RuntimeError.

Importing it also imports what DDP and the labs' setup() would import on first use, once, here,
before any group exists, so that forked ranks have it.
"""

from __future__ import annotations

import torch.distributed.nn  # noqa: F401  before any group exists: see the labs' setup()
from torch import nn

from harness.exercises import load_lesson_module

LESSON = "04_pitfalls"
DOCTOR = f"lessons/{LESSON}/doctor.py"
GRADE_TIMEOUT = 5  # s: the process-group timeout for task tests, where only a wrong answer hangs
TRUE_ACCURACY = 8 / 11  # lab 03's validation set, counted once in one process


def lab(name: str):
    """A lab script as a module: lessons/04_pitfalls/labs/<name>.py."""
    return load_lesson_module(LESSON, f"labs/{name}")


def runtime_error_from(action, expected: str) -> RuntimeError:
    """The RuntimeError ``action()`` raises. An untouched stub's NotImplementedError (itself a
    RuntimeError) passes through, so the test counts as not attempted."""
    try:
        action()
    except NotImplementedError:
        raise
    except RuntimeError as error:
        return error
    raise AssertionError(f"expected a RuntimeError: {expected}")


def mse_of_output_and_target(output, target):
    """``nn.functional.mse_loss``, which checks that it is called as ``loss_fn(output, target)``:
    MSE itself is symmetric, the losses a learner passes (cross-entropy) are not."""
    if target.requires_grad or not output.requires_grad:
        raise AssertionError("loss_fn was called as loss_fn(targets, model(inputs)): call it "
                             "as loss_fn(model(inputs), targets), the model's output first")
    return nn.functional.mse_loss(output, target)
