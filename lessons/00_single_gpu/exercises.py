"""Lesson 00 exercises: one device, done right.

Four graded functions, task0_1 to task0_4. Grade one with:

    pytest lessons/00_single_gpu -m task0_1

Everything here runs on CPU; the tests imitate a GPU machine where they need one.
"""

from __future__ import annotations

import torch


# --8<-- [start:choose_device]
def choose_device(requested: str | None = None) -> torch.device:
    """Turn a device request into a ``torch.device``, once, at the start of a program.

    - ``None`` or ``"auto"``: ``cuda`` if ``torch.cuda.is_available()``, else ``cpu``;
    - ``"cpu"``: the CPU;
    - ``"cuda"`` or ``"cuda:N"``: that device; but raise ``ValueError`` when CUDA is not
      available (with a message that names ``'cpu'`` as the way out), or when N is not below
      ``count = torch.cuda.device_count()`` (with a message that gives the valid range,
      ``cuda:0`` to ``cuda:<count - 1>``, and names no other index above it but N);
    - anything else (``"gpu"``, ``"tpu"``, ``""``, ``"cuda:x"``): ``ValueError``.

    Ask ``torch.cuda.is_available()`` / ``torch.cuda.device_count()`` when called: the test
    replaces them to imitate machines with and without GPUs, and checks every case above.
    """
    raise NotImplementedError(
        "task0_1: return the torch.device for None/'auto'/'cpu'/'cuda'/'cuda:N', else ValueError"
    )
# --8<-- [end:choose_device]


# --8<-- [start:to_device]
def to_device(batch, device: torch.device, non_blocking: bool = False):
    """Move a tensor, or a nested list / tuple / dict of them, to ``device``.

    Returns the same structure with the same container types (a tuple stays a tuple, a dict
    keeps all its keys in order) in which every tensor ``t`` is replaced by
    ``t.to(device, non_blocking=non_blocking)``; any other leaf (a string, a number, None) is
    returned untouched, as the same object. The test moves a nested batch to the ``meta``
    device and checks every leaf, every container type, and that ``non_blocking`` is passed on.
    """
    raise NotImplementedError(
        "task0_2: move every tensor of the nested list/tuple/dict to device, same containers"
    )
# --8<-- [end:to_device]


# --8<-- [start:train_step]
def train_step(model: torch.nn.Module, batch, loss_fn, optimizer) -> float:
    """One optimisation step on ``batch = (inputs, targets)``; returns the loss as a float.

    In order: clear the gradients left by earlier steps, compute ``loss_fn(model(inputs),
    targets)``, back-propagate, step the optimizer. Return the loss (computed before the step)
    as a Python ``float``. The test runs two steps on a model whose ``.grad`` already holds
    stale values and compares every parameter and both losses with its own reference loop.
    """
    raise NotImplementedError(
        "task0_3: zero the grads, forward, loss, backward, optimizer step; return a float"
    )
# --8<-- [end:train_step]


# --8<-- [start:evaluate]
def evaluate(model: torch.nn.Module, loader, loss_fn) -> float:
    """The exact mean loss per sample over every batch ``(inputs, targets)`` of ``loader``.

    ``loss_fn`` averages over its batch (``reduction="mean"``), and the last batch may be
    smaller than the others: weigh each batch by its number of samples, so the answer equals
    the loss of the whole data set at once. Run the model in eval mode with gradients off
    (``torch.no_grad()``), and leave it in the training/eval mode it was in before. Return a
    Python ``float``. The test uses 10 samples in batches of 4, 4 and 2, and checks the mode
    and grad state seen inside the forward pass and the mode afterwards.
    """
    raise NotImplementedError(
        "task0_4: exact mean loss per sample, eval mode + no_grad, then restore the mode"
    )
# --8<-- [end:evaluate]
