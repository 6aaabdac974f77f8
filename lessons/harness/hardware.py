"""What this machine has, and skips that say which hardware a check needs.

Every hardware skip reason starts with "needs " so that the course's integrity tests can tell a
skip for missing hardware from any other skip.
"""

from __future__ import annotations

import functools

import pytest
import torch


@functools.cache
def cuda_device_count() -> int:
    """Visible CUDA devices. ``device_count`` asks NVML first, so counting does not initialise
    CUDA in this process (CUDA pools spawn their ranks all the same)."""
    return torch.cuda.device_count()


def gpu_skip_reason(n: int = 1, what: str = "") -> str | None:
    """None when ``n`` GPUs are present, else the skip reason naming the hardware needed."""
    found = cuda_device_count()
    if found >= n:
        return None
    gpus = "a CUDA GPU" if n == 1 else f"{n} CUDA GPUs"
    why = f" ({what})" if what else ""
    return f"needs {gpus}{why}; this machine has {found}"


def gpu_marks(n: int = 1, what: str = "") -> list:
    """Marks for a check that needs ``n`` GPUs: the ``gpu`` marker and a skip with the reason."""
    reason = gpu_skip_reason(n, what)
    return [pytest.mark.gpu, pytest.mark.skipif(reason is not None, reason=reason or "")]


def needs_gpus(n: int = 1, what: str = ""):
    """Decorator form of :func:`gpu_marks`."""

    def apply(test):
        for mark in gpu_marks(n, what):
            test = mark(test)
        return test

    return apply
