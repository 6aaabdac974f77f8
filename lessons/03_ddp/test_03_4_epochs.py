"""Grades task3_4, train_one_epoch: W ranks of DDP take exactly the steps of one process on the
global batches, and report the epoch's mean loss over every sample of every rank.

    pytest lessons/03_ddp -m task3_4
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from harness.compare import assert_close, assert_parameters_close, full_fp32
from harness.exercises import load_exercise
from harness.ranks import run_on_ranks
from lesson03.common import (
    EPOCHS,
    GROUPS,
    LESSON,
    make_data,
    make_model,
    one_process_on_global_batches,
    train_epochs,
    with_diagnosis,
)

# This task's contract, clause by clause, and the tests that fail when only that clause
# is broken (tests/test_course.py checks the names).
CLAUSES = {
    "task3_4": {
        "forward, loss: loss_fn(model(inputs), targets)": [
            "test_train_one_epoch_weighs_each_batch_by_its_size"],
        "sum loss * batch size and the sample count on each rank": [
            "test_train_one_epoch_weighs_each_batch_by_its_size"],
        "tell the sampler the epoch first": [
            "test_train_one_epoch_equals_one_process_on_global_batches"],
        "zero the gradients, forward, loss, backward, step": [
            "test_train_one_epoch_equals_one_process_on_global_batches"],
        "return the mean loss per sample over the whole epoch and all ranks": [
            "test_train_one_epoch_equals_one_process_on_global_batches"],
        "move each batch to the model's device": [
            "test_train_one_epoch_weighs_each_batch_by_its_size"],
    },
}


# The DDP loop around train_one_epoch (train_epochs, a rank function) and the one process
# it must equal (one_process_on_global_batches) are in common.py: the lesson's own check
# of real DDP runs the same loop with the plain step in place of the exercise.
@pytest.mark.task3_4
@pytest.mark.parametrize("group", GROUPS)
def test_train_one_epoch_equals_one_process_on_global_batches(group):
    """Two epochs of train_one_epoch under DDP (36 samples, batches of 3 per rank, SGD) set the
    sampler's epoch, leave one process's parameters after the same global batches, and return one
    process's mean loss per epoch, as the same float on every rank: 2 and 3 gloo ranks on the CPU,
    and on GPUs.

    The GPU cases: 2 gloo ranks sharing cuda:0, and nccl with one rank per GPU."""
    world, backend, device = group
    expected_params, expected_losses = one_process_on_global_batches(world)
    results = run_on_ranks(train_epochs, use_exercise=True, world_size=world, backend=backend,
                           device=device)
    for rank, result in enumerate(results):
        assert isinstance(result["losses"][0], float), (
            f"rank {rank}: train_one_epoch must return a Python float, "
            f"got {type(result['losses'][0]).__name__}"
        )
        for epoch, seen in enumerate(result["sampler_epochs"]):
            assert seen == epoch, (
                f"rank {rank}: after train_one_epoch(..., epoch={epoch}) the sampler's epoch is "
                f"still {seen}: call loader.sampler.set_epoch(epoch) before the loop, or every "
                f"epoch reads the same order")
    for rank, result in enumerate(results[1:], start=1):
        try:
            assert_parameters_close(result["parameters"], results[0]["parameters"], rank=rank,
                                    what=f"parameter after {EPOCHS} epochs, vs rank 0's")
        except AssertionError as error:
            raise with_diagnosis(
                error, "the ranks' parameters differ from each other: their gradients were not "
                "averaged. Run the forward through the DDP model, model(inputs), not "
                "model.module(inputs)") from None
    for rank, result in enumerate(results):
        assert_parameters_close(result["parameters"], expected_params, rank=rank,
                                what=f"parameter after {EPOCHS} epochs")
    for epoch in range(EPOCHS):
        returned = [result["losses"][epoch] for result in results]
        assert max(returned) - min(returned) <= 1e-9 * max(1.0, abs(returned[0])), (
            f"the ranks returned different losses for epoch {epoch}: {returned}: each returned "
            f"its own shard's mean. all_reduce the loss sum and the sample count, then divide")
    for rank, result in enumerate(results):
        for epoch, (got, want) in enumerate(zip(result["losses"], expected_losses, strict=True)):
            assert_close(torch.tensor(got), torch.tensor(want), rank=rank,
                         what=f"mean loss of epoch {epoch} (all samples, all ranks)")


def frozen_epoch(ctx, samples: int, batch_size: int):
    """One epoch of train_one_epoch with lr=0 (the model stays as it is), recording the order
    of the arguments loss_fn receives."""
    with full_fp32():  # compared with a CPU run: no TF32
        inputs, targets = make_data(samples)
        dataset = TensorDataset(inputs, targets)
        sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, seed=0)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
        model = DDP(make_model().to(ctx.device),
                    device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        swapped = []

        def loss_fn(outputs, batch_targets):
            swapped.append(not outputs.requires_grad and batch_targets.requires_grad)
            return nn.functional.mse_loss(outputs, batch_targets)

        yielded, moved = [], []

        class RecordedLoader:
            """The loader, noting each batch it yields."""
            sampler = loader.sampler

            def __iter__(self):
                for batch in loader:
                    yielded.extend(batch)
                    yield batch

            def __len__(self):
                return len(loader)

        real_to = torch.Tensor.to

        def recording_to(self, *args, **kwargs):
            moved.append(self)
            return real_to(self, *args, **kwargs)

        torch.Tensor.to = recording_to
        try:
            loss = load_exercise(LESSON).train_one_epoch(model, RecordedLoader(), optimizer,
                                                         loss_fn, 0)
        finally:
            torch.Tensor.to = real_to
        unmoved = sum(not any(t is m for m in moved) for t in yielded)
        return {"loss": loss, "swapped": swapped, "unmoved": unmoved, "yielded": len(yielded)}


@pytest.mark.task3_4
def test_train_one_epoch_weighs_each_batch_by_its_size():
    """With lr 0, train_one_epoch on 2 gloo ranks, 10 samples in batches of 3 and 2 per rank,
    returns the mean loss per sample over all 10, moves every batch with .to(device), and calls
    loss_fn(outputs, targets) in that order."""
    samples, batch_size = 10, 3  # 5 samples per rank: batches of 3 and 2
    results = run_on_ranks(frozen_epoch, samples, batch_size, world_size=2)
    inputs, targets = make_data(samples)
    with torch.no_grad():
        expected = nn.functional.mse_loss(make_model()(inputs), targets).item()
    for rank, result in enumerate(results):
        assert result["unmoved"] == 0, (
            f"rank {rank}: {result['unmoved']} of the {result['yielded']} tensors the loader "
            f"yielded were never moved with .to(device): move each batch to the model's device "
            f"(on a GPU the data comes on the CPU)")
        assert not any(result["swapped"]), (
            f"rank {rank}: loss_fn got (targets, outputs): call loss_fn(model(inputs), targets), "
            f"outputs first")
        assert_close(torch.tensor(result["loss"]), torch.tensor(expected), rank=rank,
                     what="mean loss per sample of an epoch with lr=0 (10 samples on 2 ranks in "
                          "batches of 3 and 2: weigh each batch's mean loss by its size)")
