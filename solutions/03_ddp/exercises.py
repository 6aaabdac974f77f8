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
    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        order = torch.randperm(dataset_len, generator=generator).tolist()
    else:
        order = list(range(dataset_len))
    if drop_last:
        per_rank = dataset_len // num_replicas
        order = order[: per_rank * num_replicas]
    else:
        per_rank = math.ceil(dataset_len / num_replicas)
        padding = per_rank * num_replicas - dataset_len
        # Repeat the whole order as often as needed: padding can exceed the dataset itself.
        order += (order * math.ceil(padding / max(dataset_len, 1)))[:padding]
    return order[rank::num_replicas]
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
    present = [name for name in LAUNCHER_VARIABLES if name in os.environ]
    if not present:
        raise RuntimeError(
            "no launcher environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): "
            "start this script with torchrun --standalone --nproc-per-node=N"
        )
    missing = [name for name in LAUNCHER_VARIABLES if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"the launcher set {present} but not {missing}: start this script with torchrun, "
            "which sets all of them"
        )
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        backend = "nccl" if gpus >= local_world_size else "gloo"
    if backend == "nccl":
        if gpus == 0:
            raise RuntimeError("backend nccl needs CUDA GPUs and none is visible: use gloo")
        if gpus < local_world_size:
            raise RuntimeError(
                f"backend nccl needs one GPU per rank: {local_world_size} ranks on this machine "
                f"but {gpus} GPU(s) visible; start fewer ranks or use gloo"
            )
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method="env://",
                            timeout=datetime.timedelta(seconds=30))
    return DistInfo(rank, local_rank, world_size, local_world_size, backend, device)
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
    world_size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
            param.grad /= world_size
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
    loader.sampler.set_epoch(epoch)
    device = next(model.parameters()).device
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, samples
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        totals[0] += loss.detach().double() * len(inputs)  # on the device: no sync per step
        totals[1] += len(inputs)
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()
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
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets: list[list[nn.Parameter]] = []
        current: list[nn.Parameter] = []
        size = 0
        for param in reversed(params):
            if current and size + param.numel() > bucket_size:
                self.buckets.append(current)
                current, size = [], 0
            current.append(param)
            size += param.numel()
        if current:
            self.buckets.append(current)
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)
        self.pending: list[tuple[int, torch.Tensor, dist.Work]] = []
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                        for p in params]

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        index = self.bucket_of[param]
        self.ready[index] += 1
        if self.ready[index] == len(self.buckets[index]):
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[index]])
            work = dist.all_reduce(flat, async_op=True)
            self.pending.append((index, flat, work))

    def wait(self) -> None:
        world_size = dist.get_world_size()
        for index, flat, work in self.pending:
            work.wait()
            flat /= world_size
            offset = 0
            for param in self.buckets[index]:
                count = param.numel()
                param.grad.copy_(flat[offset: offset + count].view_as(param.grad))
                offset += count
        self.pending.clear()
        self.ready = [0] * len(self.buckets)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
# --8<-- [end:GradientBuckets]
