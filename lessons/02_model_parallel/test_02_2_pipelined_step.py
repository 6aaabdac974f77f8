"""Grades task2_2, pipelined_step: a step over m micro-batches, every forward before the first
backward, whose gradients and loss are those of one step on the full batch.

    pytest lessons/02_model_parallel -m task2_2
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.compare import assert_close
from harness.exercises import task_of
from harness.hardware import gpu_marks
from lesson02.common import (
    TwoStageNet,
    assert_gradients_equal,
    assert_pipelined_training_matches,
    assert_refused,
    make_batch,
    split_sizes,
)

# This task's contract, clause by clause, and the tests that fail when only that clause
# is broken (tests/test_course.py checks the names).
CLAUSES = {
    "task2_2": {
        "split inputs and targets with torch.tensor_split into exactly m micro-batches": [
            "test_pipelined_step_feeds_the_model_m_consecutive_micro_batches"],
        "the forward of every micro-batch first, then the backward": [
            "test_pipelined_step_runs_every_forward_before_the_first_backward"],
        "on GPUs, stage 0 then works on micro-batch i + 1 while stage 1 works on i": (
            "not testable on CPU: CPU ops finish before the next call starts, so stages never "
            "run at once; the schedule that lets GPUs overlap is the forward-first order above"),
        "weigh micro-batch i's loss by size_i / batch_size": [
            "test_pipelined_step_gradients_equal_one_full_batch_step",
            "test_pipelined_training_equals_full_batch_training"],
        "add them to any gradients already there": [
            "test_pipelined_step_adds_to_gradients_already_there"],
        "move each target micro-batch to the device of its output": [
            "test_pipelined_step_moves_each_target_micro_batch_to_its_output_device",
            "test_pipelined_training_equals_full_batch_training_on_device_pairs"],
        "m from 1 to B; anything else is a ValueError": [
            "test_pipelined_step_refuses_impossible_micro_batch_counts"],
        "return the full batch's mean loss as a Python float": [
            "test_pipelined_step_gradients_equal_one_full_batch_step"],
    },
}

# For the pipelined step the output must land on a GPU while the targets start on the CPU, so
# that forgetting to move the targets shows: cpu/cuda:0 instead of cuda:0/cpu.
PIPELINE_PAIRS = [
    pytest.param(("cpu", "cpu"), id="cpu-cpu"),
    pytest.param(("cpu", "cuda:0"), id="cpu-cuda0",
                 marks=gpu_marks(1, "a pipelined model split across the CPU and cuda:0")),
    pytest.param(("cuda:0", "cuda:1"), id="cuda0-cuda1",
                 marks=gpu_marks(2, "a pipelined model split across cuda:0 and cuda:1")),
]


LOSSES = {"mse": F.mse_loss, "cross_entropy": F.cross_entropy}


def hand_weighted_grads(inputs, targets, loss_fn, m: int, weights: str) -> dict:
    """Gradients of the sum of the micro-batch mean losses under a given (wrong) weighting."""
    model = TwoStageNet()
    for x, y in zip(inputs.tensor_split(m), targets.tensor_split(m), strict=True):
        weight = 1 / m if weights == "1/m" else 1.0
        (loss_fn(model(x), y) * weight).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def matches(model, grads: dict) -> bool:
    return all(p.grad is not None and torch.allclose(p.grad, grads[name], rtol=1e-5, atol=1e-7)
               for name, p in model.named_parameters())


@pytest.mark.task2_2
@pytest.mark.parametrize(("batch_size", "m", "loss_name"), [
    (8, 1, "mse"), (8, 2, "mse"), (8, 4, "mse"), (7, 7, "mse"),
    (10, 3, "mse"), (10, 4, "mse"), (10, 4, "cross_entropy"), (9, 2, "cross_entropy"),
])
def test_pipelined_step_gradients_equal_one_full_batch_step(ex, batch_size, m, loss_name):
    """pipelined_step returns one full-batch step's loss, as a float, and leaves its gradients: MSE
    for 8 samples in 1, 2 and 4 micro-batches, 7 in 7, 10 in 3 and in 4; cross-entropy for 10 in 4
    and 9 in 2.

    When the gradients are those of a 1/m weighting or of an unweighted sum, the failure says so."""
    loss_fn = LOSSES[loss_name]
    inputs, targets = make_batch(batch_size, classes=loss_name == "cross_entropy")
    model, reference = TwoStageNet(), TwoStageNet()
    got = ex.pipelined_step(model, inputs, targets, loss_fn, m)

    expected = loss_fn(reference(inputs), targets)
    expected.backward()
    what = f"batch of {batch_size} in {m} micro-batches {split_sizes(batch_size, m)}, {loss_name}"
    assert isinstance(got, float), (
        f"pipelined_step returned a {type(got).__name__}, expected a Python float"
    )
    expected_grads = {name: p.grad for name, p in reference.named_parameters()}
    if not matches(model, expected_grads):
        for weights, advice in (
            ("1/m", "weighting each micro-batch's mean loss by 1/m is only right when all "
                    "micro-batches have the same size; weigh it by size_i / batch_size"),
            ("none", "the micro-batch mean losses were added without weights; weigh each by "
                     "size_i / batch_size so that together they make the full batch's mean"),
        ):
            if matches(model, hand_weighted_grads(inputs, targets, loss_fn, m, weights)):
                pytest.fail(f"{what}: your gradients are those of a wrong loss scaling: {advice}")
    assert_gradients_equal(model, reference, what)
    assert_close(got, expected.item(), f"{what}: returned loss (the full batch's mean loss)")


@pytest.mark.task2_2
@pytest.mark.parametrize(("batch_size", "m"), [(10, 4), (6, 4), (5, 5), (8, 1)])
def test_pipelined_step_feeds_the_model_m_consecutive_micro_batches(ex, batch_size, m):
    """pipelined_step runs the model on exactly m micro-batches of torch.tensor_split's sizes that,
    joined in order, are the batch: 10 samples in 4, 6 in 4 (torch.chunk would make 3), 5 in 5 and 8
    in 1."""
    inputs, targets = make_batch(batch_size)
    model = TwoStageNet()
    ex.pipelined_step(model, inputs, targets, F.mse_loss, m)
    sizes = [n for kind, n in model.log if kind == "forward"]
    expected = split_sizes(batch_size, m)
    assert sizes == expected, (
        f"a batch of {batch_size} in m={m}: the model ran on micro-batches of sizes {sizes}, "
        f"expected {expected}: use torch.tensor_split(inputs, m), which makes exactly m "
        "micro-batches whose sizes differ by at most one (torch.chunk can make fewer)"
    )
    assert_close(torch.cat(model.inputs_seen), inputs,
                 "the micro-batches the model received, joined in order (expected the batch)")


@pytest.mark.task2_2
def test_pipelined_step_runs_every_forward_before_the_first_backward(ex):
    """pipelined_step on 8 samples in 4 micro-batches runs all 4 forwards before the first backward,
    and the backward goes through all 4 micro-batches."""
    inputs, targets = make_batch(8)
    model = TwoStageNet()
    ex.pipelined_step(model, inputs, targets, F.mse_loss, 4)
    order = [kind for kind, _ in model.log]
    assert order.count("backward") == 4, (
        f"the backward ran through {order.count('backward')} micro-batches, expected all 4"
    )
    first_backward = order.index("backward")
    assert order[:first_backward] == ["forward"] * 4, (
        f"the calls came in the order {order}; GPipe runs the forward of every micro-batch "
        "first (that is what lets the stages overlap), then the backward: keep each "
        "micro-batch's weighted loss and call backward after the last forward, e.g. once on "
        "their sum"
    )


@pytest.mark.task2_2
def test_pipelined_step_adds_to_gradients_already_there(ex):
    """pipelined_step adds to gradients already there, as backward does: from gradients of ones, 10
    samples in 3 micro-batches leave ones plus the full batch's gradient."""
    inputs, targets = make_batch(10)
    model, reference = TwoStageNet(), TwoStageNet()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    ex.pipelined_step(model, inputs, targets, F.mse_loss, 3)
    F.mse_loss(reference(inputs), targets).backward()
    batch_only = {name: p.grad.clone() for name, p in reference.named_parameters()}
    for p in reference.parameters():
        p.grad += 1
    if not matches(model, {n: p.grad for n, p in reference.named_parameters()}) and \
            matches(model, batch_only):
        pytest.fail(
            "pipelined_step on a model whose .grad held ones left only the batch's gradient: "
            "the ones were thrown away. Accumulate like backward, do not zero (no "
            "model.zero_grad() and no assigning .grad inside the step: clearing is the caller's)"
        )
    assert_gradients_equal(
        model, reference,
        "gradient after pipelined_step on a model whose .grad held ones (expected ones + the "
        "batch's gradient: accumulate like backward, do not zero)")


@pytest.mark.task2_2
def test_pipelined_step_moves_each_target_micro_batch_to_its_output_device(ex):
    """pipelined_step moves each target micro-batch to its output's device: with the last stage on
    meta and the targets on the CPU, each of the 3 loss calls gets output and target on the same
    device."""
    # The second stage on meta: the outputs land there while the targets start on the CPU, as
    # they would with the last stage on a GPU. The loss only records where its two arguments
    # are and returns a CPU number, so nothing has to be computed on meta.
    inputs, targets = make_batch(10)
    model = TwoStageNet(("cpu", "meta"))
    seen = []

    def recording_loss(output, target):
        seen.append((output.device, target.device))
        return torch.ones((), requires_grad=True) * 1.0

    where = "pipelined_step on stages cpu -> meta (the last stage's outputs on meta)"
    try:
        ex.pipelined_step(model, inputs, targets, recording_loss, 3)
    except Exception as err:
        if task_of(err):  # the untouched stub: reported as "not attempted yet"
            raise
        pytest.fail(f"{where} raised {type(err).__name__}: {str(err).splitlines()[0]}")
    assert len(seen) == 3, f"{where}: loss_fn was called {len(seen)} times for 3 micro-batches"
    wrong = [(i, str(t)) for i, (o, t) in enumerate(seen) if t != o]
    assert not wrong, (
        f"{where}: loss_fn received targets on the CPU for micro-batches "
        f"{[i for i, _ in wrong]} while their outputs were on meta: move each target "
        "micro-batch to its output's device first, loss_fn(output, y.to(output.device))"
    )


@pytest.mark.task2_2
@pytest.mark.parametrize("m", [0, -1, 11])
def test_pipelined_step_refuses_impossible_micro_batch_counts(ex, m):
    """pipelined_step refuses 0, -1 and 11 micro-batches for a batch of 10 with a ValueError."""
    inputs, targets = make_batch(10)
    assert_refused(lambda: ex.pipelined_step(TwoStageNet(), inputs, targets, F.mse_loss, m),
                   f"pipelined_step(num_micro_batches={m}) for a batch of 10",
                   "check 1 <= num_micro_batches <= batch size before splitting")


# assert_pipelined_training_matches is in common.py: the lesson's own check (in
# test_02_model_parallel.py) shows that it catches a naive 1/m weighting.
@pytest.mark.task2_2
@pytest.mark.parametrize(("batch_size", "m"), [(8, 4), (10, 4), (10, 3)],
                         ids=["even", "uneven-4", "uneven-3"])
def test_pipelined_training_equals_full_batch_training(ex, batch_size, m):
    """Three SGD steps (momentum 0.5) with pipelined_step leave full-batch training's loss and
    parameters after each step, on cpu/cpu: 8 samples in 4 micro-batches, 10 in 4 (3, 3, 2, 2) and
    10 in 3 (4, 3, 3)."""
    assert_pipelined_training_matches(ex.pipelined_step, batch_size, m)


@pytest.mark.task2_2
@pytest.mark.parametrize("devices", PIPELINE_PAIRS)
def test_pipelined_training_equals_full_batch_training_on_device_pairs(ex, devices, no_tf32):
    """Three SGD steps with pipelined_step, 10 samples in 3 micro-batches, leave full-batch
    training's loss and parameters on the CPU, with TF32 off: on cpu/cpu, on cpu/cuda:0 with a GPU,
    on cuda:0/cuda:1 with two.

    cpu/cuda:0 puts the output on a GPU while the targets start on the CPU, so a target left behind
    shows."""
    assert_pipelined_training_matches(ex.pipelined_step, 10, 3, devices=devices)
