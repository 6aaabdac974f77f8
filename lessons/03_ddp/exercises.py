"""Lesson 03 exercises: the pieces of distributed data parallel, written by hand.

Grade with ``pytest lessons/03_ddp`` (one task: ``-m task3_1``). Each function's docstring is its
contract: what it takes, what it returns, and what the test checks.
"""

from __future__ import annotations

import datetime
import math
import os
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn


# --8<-- [start:shard_indices]
def shard_indices(dataset_len: int, num_replicas: int, rank: int, shuffle: bool = True,
                  seed: int = 0, epoch: int = 0, drop_last: bool = False) -> list[int]:
    """The dataset indices that ``DistributedSampler`` yields on ``rank``, in order.

    Reproduce ``DistributedSampler(dataset, num_replicas, rank, shuffle, seed, drop_last)``
    after ``set_epoch(epoch)`` exactly: the same permutation on every rank (a ``torch.Generator``
    seeded with ``seed + epoch``, then ``torch.randperm``), the tail padded by repeating indices
    from the start (or cut, with ``drop_last``) so every rank gets the same number, then every
    ``num_replicas``-th index starting at ``rank``.

    The test compares your list with the real sampler for many lengths (also smaller than the
    number of replicas), world sizes, ranks, seeds, epochs, with shuffle and drop_last on and off.
    """
    raise NotImplementedError("task3_1: return the indices DistributedSampler yields on this rank")
# --8<-- [end:shard_indices]


class DistInfo(NamedTuple):
    """Where this process stands in the job."""

    rank: int  # 0 .. world_size - 1, unique across all machines
    local_rank: int  # 0 .. local_world_size - 1, unique on this machine: picks the GPU
    world_size: int  # processes in the whole job
    local_world_size: int  # processes on this machine
    backend: str  # "gloo" or "nccl"
    device: torch.device  # cuda:<local_rank> for nccl, cpu for gloo


LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# --8<-- [start:setup]
def setup(backend: str = "auto") -> DistInfo:
    """Join the process group the launcher (``torchrun``) described in the environment.

    - Read RANK, LOCAL_RANK, WORLD_SIZE (and LOCAL_WORLD_SIZE, default: WORLD_SIZE) and check
      that MASTER_ADDR and MASTER_PORT are set. If none of the five launcher variables is set,
      raise ``RuntimeError`` saying to launch with ``torchrun``; if only some are, raise
      ``RuntimeError`` naming the missing ones.
    - ``backend="auto"``: "nccl" when CUDA has at least LOCAL_WORLD_SIZE GPUs, else "gloo".
      ``backend="nccl"`` with no GPU, or with fewer GPUs than LOCAL_WORLD_SIZE, raises
      ``RuntimeError`` saying what is missing, before anything touches CUDA.
    - With nccl, call ``torch.cuda.set_device(local_rank)`` *before* ``init_process_group`` so
      each process talks to its own GPU; the device is ``cuda:<local_rank>``. With gloo the
      device is the CPU.
    - ``init_process_group(backend, init_method="env://", timeout=...)`` with a timeout under
      a minute, so that a missing peer becomes an error instead of a hang.

    The test runs it under ``torchrun`` and checks every field on every rank and that the group
    works; it checks each bad environment gets a ``RuntimeError`` that names the problem; and,
    with CUDA and the process group faked, it plays process 3 of 2 machines x 2 GPUs (its
    LOCAL_RANK is 1) and checks the device, the order of the calls and the timeout.
    """
    raise NotImplementedError("task3_2: read the launcher variables, pick the device, join")
# --8<-- [end:setup]


# --8<-- [start:average_gradients]
def average_gradients(model: nn.Module) -> None:
    """After ``loss.backward()``, replace every gradient by its mean over all ranks.

    In place, with ``dist.all_reduce``: sum, then divide by the world size (``ReduceOp.AVG``
    does both, on NCCL and, since torch 2.8, on gloo).
    Parameters without a gradient are skipped. Afterwards every rank holds the same
    gradients, equal to those of one process on the whole global batch (for a mean loss).

    The test compares them with DDP's and with a single-process run, on 2 and 3 ranks.
    """
    raise NotImplementedError("task3_3: all-reduce every gradient and divide by the world size")
# --8<-- [end:average_gradients]


# --8<-- [start:train_one_epoch]
def train_one_epoch(model: nn.Module, loader, optimizer: torch.optim.Optimizer, loss_fn,
                    epoch: int) -> float:
    """Train a DDP-wrapped ``model`` for one epoch; return the epoch's mean loss over all ranks.

    ``loader`` is a ``DataLoader`` whose sampler is a ``DistributedSampler``: tell it the epoch
    first, so every epoch sees a new order (the same one on every rank). Then for each batch
    ``(inputs, targets)``: move it to the model's device, zero the gradients, forward, loss,
    backward (DDP averages the gradients), step.

    Return the mean loss per sample over the whole epoch and all ranks: sum ``loss * batch
    size`` and the sample count on each rank, ``all_reduce`` both, divide.

    The test trains 2 epochs on 2 and 3 ranks and compares the final parameters with one
    process training on the same global batches, and the returned loss with the true mean.
    """
    raise NotImplementedError("task3_4: set the epoch, train every batch, all-reduce the loss")
# --8<-- [end:train_one_epoch]


# --8<-- [start:GradientBuckets]
class GradientBuckets:
    """Average gradients across ranks *while* backward runs, the way DDP does.

    ``GradientBuckets(model, bucket_size)`` groups the parameters that require a gradient
    (a frozen one is in no bucket) into buckets in reverse order (backward produces the last
    layer's gradients first), each holding up to ``bucket_size`` elements (a parameter larger
    than that gets a bucket of its own). It
    registers a hook on every parameter (``register_post_accumulate_grad_hook``) that notes the
    gradient is ready; when every parameter of a bucket is ready, the hook flattens the
    bucket's gradients into one tensor and starts ``dist.all_reduce(..., async_op=True)``.
    Communication of early buckets then overlaps the computation of later gradients.

    ``wait()``, called after ``backward()`` and before ``optimizer.step()``, waits for every
    bucket's all-reduce, divides by the world size, copies the results back into each
    ``param.grad`` and resets for the next step. ``remove()`` removes the hooks.

    The test checks the gradients equal DDP's for several steps, that the first all-reduce
    starts before backward has produced the last gradient, and that every all-reduce started
    during backward is asynchronous and waited on only in ``wait()``.
    """

    def __init__(self, model: nn.Module, bucket_size: int = 2**20):
        raise NotImplementedError("task3_5: make the buckets, register the hooks")

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        raise NotImplementedError("task3_5: start an async all-reduce when a bucket is complete")

    def wait(self) -> None:
        raise NotImplementedError("task3_5: wait, average, copy back into .grad")

    def remove(self) -> None:
        raise NotImplementedError("task3_5: remove the hooks")
# --8<-- [end:GradientBuckets]
