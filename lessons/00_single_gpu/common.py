"""What the test files of lesson 00 share: a machine with as many GPUs as a test asks for."""

import torch


def imitate_machine(monkeypatch, gpus: int) -> None:
    """Make torch.cuda report ``gpus`` devices, so every branch can be graded on a CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
