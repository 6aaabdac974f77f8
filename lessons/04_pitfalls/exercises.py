"""Lesson 04 exercises: the fixes for the pitfalls, each as a function you can reuse.

Grade with ``pytest lessons/04_pitfalls`` (one task: ``-m task4_1``). Each function's docstring is
its contract: what it takes, what it returns, and what the test checks. The functions that talk
to other ranks run inside an initialised process group (the tests start one for you).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset


# --8<-- [start:exact_accuracy]
def exact_accuracy(model: nn.Module, dataset: Dataset, batch_size: int = 32) -> float:
    """The accuracy of ``model`` on ``dataset``, every sample counted exactly once, computed
    by all ranks together; every rank returns the same Python float.

    ``dataset[i]`` is ``(inputs, target)``; the prediction is ``model(inputs).argmax(dim=1)``.
    Rank r evaluates samples r, r + W, r + 2W, ... (no padding: the shards may differ in size
    by one), under ``torch.no_grad()``, on the device of the model's parameters. Each rank sums
    its correct predictions and its samples; one ``all_reduce`` adds them over the ranks;
    return correct / total. Not a ``DistributedSampler`` (its padding counts some samples
    twice), and not the mean of the ranks' accuracies (shards of different sizes).

    The test evaluates 11 samples on 2 ranks, where padding, a missing all-reduce and the mean
    of per-rank accuracies all give a different number from one process's accuracy.
    """
    raise NotImplementedError("task4_1: evaluate a strided shard, all-reduce correct and total")
# --8<-- [end:exact_accuracy]


# --8<-- [start:pick_device]
def pick_device(env: Mapping[str, str], gpu_count: int) -> torch.device:
    """The device a process started by torchrun should use, from its environment ``env``.

    - No GPU (``gpu_count == 0``): ``torch.device("cpu")``.
    - Otherwise ``cuda:<LOCAL_RANK>``: LOCAL_RANK numbers the processes of *this machine*;
      RANK numbers those of the whole job and is not a GPU index (on the second machine of a
      2 x 2 job, RANK is 2 and 3 but the GPUs are cuda:0 and cuda:1).
    - Raise ``RuntimeError`` if LOCAL_RANK is missing (say it is set by torchrun), or if it
      is not below ``gpu_count`` (name both numbers: more processes than GPUs).

    The caller then calls ``torch.cuda.set_device(device)`` before anything touches CUDA. The
    test checks every process of an emulated 2-machine x 2-GPU job, no GPUs, and the errors.
    """
    raise NotImplementedError("task4_2: return cuda:LOCAL_RANK or the CPU; explain bad setups")
# --8<-- [end:pick_device]


# --8<-- [start:save_on_rank0]
def save_on_rank0(model: DDP, path: str | os.PathLike) -> None:
    """Save a DDP model's weights to ``path`` once, safely; called by every rank.

    - Only rank 0 writes, and it writes ``model.module.state_dict()`` (the plain module's
      names, without DDP's ``module.`` prefix).
    - It writes to a temporary file in the same folder, then ``os.replace``\\s it onto
      ``path``: at every moment ``path`` holds either the previous checkpoint or the new
      one, never half a file.
    - Every rank then waits at ``dist.barrier()``, *outside* the ``if rank == 0``: when the
      function returns on any rank, the file is complete. (Inside the ``if``, rank 0 would
      wait forever for ranks that never call it.)

    The test slows rank 0's save down, checks that one file is written once, atomically, with
    plain names, and that every rank reads the new checkpoint right after the call; a
    barrier inside the ``if`` turns into a timeout error within seconds.
    """
    raise NotImplementedError("task4_3: rank 0 writes atomically, then every rank waits")
# --8<-- [end:save_on_rank0]


# --8<-- [start:train_with_join]
def train_with_join(model: DDP, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                    optimizer: torch.optim.Optimizer, loss_fn) -> int:
    """Train a DDP ``model`` on this rank's ``batches``, which may be fewer or more than other
    ranks' batches, without hanging; return the number of steps this rank took.

    One step per ``(inputs, targets)`` (already on the model's device): zero the gradients,
    ``loss_fn(model(inputs), targets).backward()``, ``optimizer.step()``. Wrap the loop in
    ``torch.distributed.algorithms.join.Join([model])``: a rank that runs out of batches then
    shadows the others' gradient all-reduces until every rank is done, instead of leaving them
    waiting forever. Train on every batch: none is dropped.

    The test gives rank r 2 + 2r batches and compares the final weights with a reference
    Join run; without Join the test's process group times out within seconds.
    """
    raise NotImplementedError("task4_4: train on every batch inside Join([model])")
# --8<-- [end:train_with_join]


# --8<-- [start:load_checkpoint]
def load_checkpoint(path: str | os.PathLike, model: nn.Module,
                    device: torch.device) -> nn.Module:
    """Load the state dict at ``path`` into the plain (not DDP) ``model``; return ``model``.

    - ``torch.load(path, map_location=device, weights_only=True)``: without
      ``map_location`` tensors go back to the device they were saved from (cuda:0, in every
      process; an error on a machine without CUDA).
    - Strip a leading ``module.`` from the keys (a DDP model's ``state_dict()`` was saved);
      keys without it are left alone.
    - ``model.load_state_dict(state)``, strict: a missing or unexpected key is an error.

    The test loads a checkpoint written "on cuda:0" with ``module.`` prefixes into a model on
    the CPU, and checks a plain checkpoint and a wrong one too.
    """
    raise NotImplementedError("task4_5: load with map_location, strip 'module.', load strictly")
# --8<-- [end:load_checkpoint]


# --8<-- [start:accumulate_gradients]
def accumulate_gradients(model: DDP, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                         loss_fn) -> None:
    """Accumulate the gradients of k micro-batches into ``.grad`` with one all-reduce.

    For each ``(inputs, targets)``: ``(loss_fn(model(inputs), targets) / k).backward()``, the
    division making the sum of k micro-batch gradients their mean. Run all but the last
    micro-batch, its forward *and* its backward, inside ``with model.no_sync():`` (DDP decides
    in the forward whether the backward all-reduces; inside, it skips the all-reduce and the
    gradients just add up), and the last one outside it: its backward all-reduces the sum
    once. Do not zero the gradients and do not step: the caller does.

    The test counts what DDP all-reduces (each gradient exactly once) and compares ``.grad``
    with one process's gradient on all ranks' micro-batches at once.
    """
    raise NotImplementedError("task4_6: all but the last forward+backward inside no_sync")
# --8<-- [end:accumulate_gradients]


# --8<-- [start:broadcast_initial_state]
def broadcast_initial_state(model: nn.Module, src: int = 0) -> None:
    """Make every rank's ``model`` an exact copy of rank ``src``'s: every parameter *and*
    every buffer (BatchNorm's running statistics, its batch counter), in place, with
    ``dist.broadcast``. What DDP does when it wraps a model; hand-written data parallelism
    must do it itself, or ranks initialised differently never agree.

    The test builds a model with BatchNorm from a different seed on each rank, calls this
    with ``src=0`` and ``src=1``, and compares every tensor of the state dict with ``src``'s.
    """
    raise NotImplementedError("task4_7: broadcast every parameter and buffer from src")
# --8<-- [end:broadcast_initial_state]
