"""Lesson 01 exercises: data parallelism by hand, on CPU.

``nn.DataParallel`` does four things on every forward: it scatters the batch into one chunk per
device, replicates the module onto every device, runs the replicas, and gathers their outputs.
Its backward then sums the replicas' gradients into the original module. Here you build each
step from plain tensor operations and ``copy.deepcopy``, so that it runs on a laptop, and then
put them together into one step whose loss and gradients equal a single-device run.

Grade one task with ``pytest lessons/01_data_parallel -m task1_1`` (up to ``task1_6``).
"""

from __future__ import annotations

import copy  # noqa: F401  (replicate needs it)
from collections.abc import Callable

import torch
from torch import nn


# --8<-- [start:scatter_sizes]
def scatter_sizes(batch_size: int, num_replicas: int) -> list[int]:
    """How many samples each replica receives when ``nn.DataParallel`` scatters a batch.

    DataParallel cuts the batch the way ``Tensor.chunk`` does: every chunk holds
    ``ceil(batch_size / num_replicas)`` samples, except the last one, which holds what is left.
    So the split is not as even as it could be (10 samples on 3 replicas are ``[4, 4, 2]``, not
    ``[4, 3, 3]``), and there can be fewer chunks than replicas (5 on 4 are ``[2, 2, 1]``: the
    fourth device receives nothing and runs nothing).

    Args:
        batch_size: samples in the batch, at least 1.
        num_replicas: devices to split across, at least 1.

    Returns:
        The chunk sizes in order: positive, summing to ``batch_size``, at most ``num_replicas``.

    The test compares your sizes with ``torch.chunk`` for batch sizes 1..40 on 1..9 replicas.
    """
    per_chunk = -(-batch_size // num_replicas)  # ceil division, as Tensor.chunk rounds up
    full_chunks, rest = divmod(batch_size, per_chunk)
    return [per_chunk] * full_chunks + ([rest] if rest else [])
# --8<-- [end:scatter_sizes]


# --8<-- [start:scatter]
def scatter(batch: torch.Tensor, num_replicas: int) -> list[torch.Tensor]:
    """Cut ``batch`` along dim 0 into the chunks DataParallel would send to each replica.

    Chunk ``i`` holds the next ``scatter_sizes(len(batch), num_replicas)[i]`` samples, in their
    original order: the chunks, concatenated, are the batch again. Views of ``batch`` are fine
    (DataParallel then copies each chunk to its device; here every "device" is the CPU).

    Args:
        batch: a tensor of shape ``(B, ...)`` with ``B >= 1``.
        num_replicas: devices to split across, at least 1.

    Returns:
        A list of tensors of shapes ``(size_i, ...)``.

    The test checks the number of chunks, their shapes and which samples each one holds.
    """
    return list(batch.split(scatter_sizes(batch.shape[0], num_replicas), dim=0))
# --8<-- [end:scatter]


# --8<-- [start:replicate]
def replicate(model: nn.Module, num_replicas: int) -> list[nn.Module]:
    """``num_replicas`` independent copies of ``model``, one per device.

    Each replica has the same structure, the same parameter and buffer values and the same
    training mode as ``model``, but its own tensors: changing a replica's weights (or its
    gradients) never changes ``model`` or another replica. No replica is ``model`` itself, and
    every replica starts with no gradients (``.grad is None``), because a replica is made fresh
    for one forward and backward, as DataParallel does on every step.

    The test checks all of that, for a model that already has gradients.
    """
    replicas = []
    for _ in range(num_replicas):
        replica = copy.deepcopy(model)
        replica.zero_grad(set_to_none=True)  # a fresh replica has not been through backward yet
        replicas.append(replica)
    return replicas
# --8<-- [end:replicate]


# --8<-- [start:gather]
def gather(outputs: list[torch.Tensor]) -> torch.Tensor:
    """Join the replicas' outputs back into one batch, in replica order, along dim 0.

    The result must stay connected to the autograd graph of every output: a backward from it
    has to reach each replica (DataParallel's gather sends each slice of the output gradient
    back to the replica that produced it). DataParallel also moves the result to
    ``output_device``; here every output is already on the CPU.

    Args:
        outputs: tensors of shapes ``(size_i, ...)`` that agree beyond dim 0.

    Returns:
        One tensor of shape ``(sum(size_i), ...)``.

    The test checks shape, order, and that a backward reaches every output.
    """
    return torch.cat(outputs, dim=0)
# --8<-- [end:gather]


# --8<-- [start:reduce_gradients_into]
def reduce_gradients_into(master: nn.Module, replicas: list[nn.Module]) -> None:
    """Add the sum of the replicas' gradients into ``master``'s gradients, parameter by parameter.

    The replicas are copies, so their backward left gradients on their own parameters and none
    on ``master``'s. DataParallel's backward sums every replica's gradient into the original
    parameter (on the first device); do the same. Match parameters by position (the replicas
    have ``master``'s structure). Like ``loss.backward()``, accumulate: where a master parameter
    has no gradient yet it becomes the sum; where it has one, the sum is added to it. A parameter
    that no replica has a gradient for is left as it is. Do not change the replicas.

    The test gives replicas known gradients and checks every master gradient, with and without
    gradients already on ``master``.
    """
    per_replica = [list(replica.parameters()) for replica in replicas]
    for index, param in enumerate(master.parameters()):
        grads = [params[index].grad for params in per_replica if params[index].grad is not None]
        if not grads:
            continue
        total = torch.stack(grads).sum(dim=0)
        if param.grad is None:
            param.grad = total
        else:
            param.grad += total
# --8<-- [end:reduce_gradients_into]


# --8<-- [start:data_parallel_step]
def data_parallel_step(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    num_replicas: int,
) -> float:
    """One forward and backward of ``model`` on ``(inputs, targets)``, done as DataParallel does.

    Scatter ``inputs``, make one replica per chunk, run replica ``i`` on chunk ``i`` (``model``
    itself never sees the whole batch), gather the outputs, compute the loss, backward, and sum
    the replicas' gradients into ``model``. ``loss_fn(outputs, targets)`` returns the *mean*
    loss over the samples it is given (like ``nn.functional.mse_loss`` or ``cross_entropy``).

    Afterwards ``model``'s gradients are what ``loss_fn(model(inputs), targets).backward()``
    would have left (accumulated onto any gradients already there), and its parameters are
    unchanged: the optimizer step is the caller's.

    Args:
        model: the master model; its parameters receive the gradients.
        inputs: ``(B, ...)``; targets: ``(B, ...)`` matching ``loss_fn``.
        num_replicas: devices to split across, at least 1.

    Returns:
        The loss over the whole batch, as a float: the single-device loss, even when the chunks
        are uneven (10 samples on 3 replicas).

    The test compares loss and every gradient with a single-device run, for even and uneven
    splits, and checks that the model ran once per chunk with the scattered sizes.
    """
    chunks = scatter(inputs, num_replicas)
    replicas = replicate(model, len(chunks))
    outputs = [replica(chunk) for replica, chunk in zip(replicas, chunks, strict=True)]
    # The loss is taken over the gathered batch, on the "output device", as with DataParallel:
    # a plain mean of per-chunk mean losses would weigh a short last chunk too much.
    loss = loss_fn(gather(outputs), targets)
    loss.backward()
    reduce_gradients_into(model, replicas)
    return loss.item()
# --8<-- [end:data_parallel_step]
