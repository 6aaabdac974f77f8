"""Lesson 02 exercises: one model split across devices, then pipelined.

When a model does not fit on one device, its consecutive layers ("stages") go on different
devices and the activations travel from one to the next. Here you write that placement and its
forward (task2_1), a GPipe-style step over micro-batches whose gradients equal the full batch's
(task2_2), and the fraction of a GPipe schedule that every device spends idle (task2_3).

Grade one task with ``pytest lessons/02_model_parallel -m task2_1`` (up to ``task2_3``).

Everything runs on a CPU: the tests use ``cpu`` twice as a "pair of devices" for the numbers,
and the ``meta`` device (tensors with a shape but no data) to see where each stage's weights and
inputs really are. With GPUs the same tests also run on ``cuda:0``/``cpu`` and on
``cuda:0``/``cuda:1``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn


# --8<-- [start:staged_model]
class StagedModel(nn.Module):
    """Consecutive stages of one model; stage ``k`` lives on ``devices[k]``.

    Made by :func:`place_stages`, which moves each stage to its device; this class only holds
    them. The stages sit in an ``nn.ModuleList`` named ``stages``, so ``parameters()``,
    ``state_dict()`` and an optimizer see every stage's weights, wherever they live.
    """

    def __init__(self, stages: Sequence[nn.Module], devices: Sequence[torch.device | str]):
        super().__init__()
        if len(stages) != len(devices):
            raise ValueError(f"{len(stages)} stages but {len(devices)} devices: one device each")
        self.stages = nn.ModuleList(stages)
        self.devices = [torch.device(d) for d in devices]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the stages in order, each one on its own device.

        Before stage ``k`` runs, move its input (the batch for stage 0, the previous stage's
        output after that) to ``self.devices[k]``. Do not cut the autograd graph between stages
        (no ``.detach()``, ``.data`` or ``torch.tensor(x)``): the copy to another device is an
        operation autograd records, and its backward copies the gradient back.

        Args:
            x: the input batch, on any device.

        Returns:
            The last stage's output, on the last stage's device (where the loss is computed).

        The test records the device of every input each stage receives, checks the output's
        device, and compares output and every gradient with the same stages run on one device.
        """
        for stage, device in zip(self.stages, self.devices, strict=True):
            # Autograd records the copy: backward sends the gradient back to the previous device.
            x = stage(x.to(device))
        return x
# --8<-- [end:staged_model]


# --8<-- [start:place_stages]
def place_stages(stages: Sequence[nn.Module],
                 devices: Sequence[torch.device | str]) -> StagedModel:
    """Put stage ``k`` on ``devices[k]`` and return them together as one :class:`StagedModel`.

    Move every parameter *and buffer* of each stage (``Module.to`` moves both, in place).
    Several stages may share a device. One device per stage: a different number of devices is
    a ``ValueError``.

    Args:
        stages: the model's consecutive parts, e.g. ``[nn.Sequential(...), nn.Sequential(...)]``.
        devices: one device (``torch.device`` or a string such as ``"cuda:1"``) per stage.

    Returns:
        ``StagedModel(stages, devices)`` holding the moved stages.

    The test places stages on ``cpu`` and ``meta`` and checks where every parameter and buffer
    of each stage lives, then trains the placed model against the unsplit one.
    """
    devices = [torch.device(d) for d in devices]
    if len(stages) != len(devices):
        raise ValueError(f"{len(stages)} stages but {len(devices)} devices: one device each")
    for stage, device in zip(stages, devices, strict=True):
        stage.to(device)
    return StagedModel(stages, devices)
# --8<-- [end:place_stages]


# --8<-- [start:pipelined_step]
def pipelined_step(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    num_micro_batches: int,
) -> float:
    """One forward and backward of ``model`` on the batch, in ``num_micro_batches`` pieces.

    Split ``inputs`` and ``targets`` along dim 0 with ``torch.tensor_split`` into exactly
    ``m = num_micro_batches`` consecutive micro-batches (sizes differ by at most one: 10 samples
    in 4 are ``3, 3, 2, 2``). Run GPipe's schedule: the forward of every micro-batch first (on
    GPUs, stage 0 then works on micro-batch ``i + 1`` while stage 1 works on ``i``), then the
    backward. Move each target micro-batch to the device of its output before the loss.

    ``loss_fn`` returns the *mean* loss over the samples it is given. Weigh micro-batch ``i``'s
    loss by ``size_i / batch_size`` (not by ``1 / m``, which is only right when the sizes are
    equal), so that the gradients are those of the full batch's mean loss. Like
    ``loss.backward()``, add them to any gradients already there; the optimizer step is the
    caller's.

    Args:
        model: any module, e.g. a :class:`StagedModel`; it receives one micro-batch per call.
        inputs: ``(B, ...)``; targets: ``(B, ...)`` as ``loss_fn`` expects.
        num_micro_batches: ``m``, from 1 to ``B``; anything else is a ``ValueError``.

    Returns:
        The full batch's mean loss as a Python float.

    The test checks the micro-batches the model receives, that every forward runs before the
    first backward, the loss and every gradient against one full-batch step (10 samples in 3 and
    in 4), and several optimizer steps against full-batch training.
    """
    batch_size = inputs.shape[0]
    if not 1 <= num_micro_batches <= batch_size:
        raise ValueError(f"num_micro_batches must be between 1 and the batch size {batch_size}, "
                         f"got {num_micro_batches}")
    micro_inputs = torch.tensor_split(inputs, num_micro_batches)
    micro_targets = torch.tensor_split(targets, num_micro_batches)
    # GPipe: every forward first. On GPUs the calls return before the kernels finish, so the
    # stages of consecutive micro-batches overlap; their graphs stay alive until the backward.
    weighted_losses = []
    for x, y in zip(micro_inputs, micro_targets, strict=True):
        output = model(x)
        weight = x.shape[0] / batch_size  # this micro-batch's share of the full batch's mean
        weighted_losses.append(loss_fn(output, y.to(output.device)) * weight)
    loss = torch.stack(weighted_losses).sum()
    loss.backward()  # one backward through every micro-batch's graph
    return loss.item()
# --8<-- [end:pipelined_step]


# --8<-- [start:bubble_fraction]
def bubble_fraction(num_stages: int, num_micro_batches: int) -> float:
    """The fraction of a GPipe step that each device spends idle (the "bubble").

    In GPipe's schedule stage ``s`` runs the forward of micro-batch ``i`` at time step ``s + i``,
    so the forward phase takes ``m + p - 1`` steps for ``p`` stages and ``m`` micro-batches, of
    which each stage is busy for ``m``; the backward phase is the mirror image. Return the idle
    share of the whole step, as a Python float: 0 for one stage, ``(p - 1) / p`` for one
    micro-batch (only one device works at a time).

    Args:
        num_stages: ``p``, at least 1; num_micro_batches: ``m``, at least 1. Anything smaller is
            a ``ValueError``.

    The test compares your answer with a step-by-step simulation of the schedule (a grid of
    time steps in which it counts the idle slots) for 1 to 8 stages and 1 to 16 micro-batches.
    """
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError(f"need at least one stage and one micro-batch, got num_stages="
                         f"{num_stages}, num_micro_batches={num_micro_batches}")
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)
# --8<-- [end:bubble_fraction]
