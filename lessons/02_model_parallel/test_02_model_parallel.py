"""Lesson 02: grades the exercises (task2_1 .. task2_3) and checks the lesson's own claims.

    pytest lessons/02_model_parallel               # everything
    pytest lessons/02_model_parallel -m task2_2    # one task
    pytest lessons/02_model_parallel -m gpu        # only the checks on CUDA devices

Without a GPU, every split runs on ``cpu``/``cpu`` (the numbers) and on ``cpu``/``meta`` (where
things live); the ``cuda:0``/``cpu`` and ``cuda:0``/``cuda:1`` checks skip with the hardware they
need.
"""

from __future__ import annotations

import copy
import math
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from gpt import GPT, SIZES, CharDataset, GPTConfig, parameter_digest, run, train_val_split
from torch import nn
from torch.utils.data import Subset

from harness.compare import assert_close, assert_parameters_close, full_fp32
from harness.exercises import (
    LESSONS_DIR,
    load_exercise,
    load_lesson_module,
    task_of,
)
from harness.hardware import cuda_device_count, gpu_marks
from harness.launch import start_first, start_script

LESSON = "02_model_parallel"
META = torch.device("meta")  # tensors with a shape and no data: where a tensor is, made visible

# Each task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task2_1": {
        "before stage k runs, move its input to self.devices[k]": [
            "test_forward_moves_each_stage_input_to_that_stage_device"],
        "its input: the batch for stage 0 too, not only the activations between stages": [
            "test_forward_moves_each_stage_input_to_that_stage_device"],
        "do not cut the autograd graph between stages": [
            "test_split_model_equals_the_unsplit_model_on_one_device"],
        "return the last stage's output, on the last stage's device": [
            "test_forward_moves_each_stage_input_to_that_stage_device"],
        "put stage k on devices[k]: every parameter and buffer": [
            "test_place_stages_puts_every_parameter_and_buffer_of_stage_k_on_device_k"],
        "several stages may share a device": [
            "test_place_stages_puts_every_parameter_and_buffer_of_stage_k_on_device_k"],
        "a different number of devices is a ValueError": [
            "test_place_stages_accepts_torch_devices_and_refuses_a_missing_device"],
        "devices may be torch.device or strings": [
            "test_place_stages_accepts_torch_devices_and_refuses_a_missing_device",
            "test_place_stages_puts_every_parameter_and_buffer_of_stage_k_on_device_k"],
        "return StagedModel(stages, devices) holding the moved stages": [
            "test_place_stages_puts_every_parameter_and_buffer_of_stage_k_on_device_k",
            "test_place_stages_returns_a_model_whose_state_dict_holds_every_stage"],
    },
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
    "task2_3": {
        "the idle share of the whole GPipe step, as a Python float": [
            "test_bubble_fraction_matches_a_simulated_gpipe_schedule"],
        "0 for one stage, (p - 1) / p for one micro-batch": [
            "test_bubble_fraction_matches_a_simulated_gpipe_schedule"],
        "num_stages or num_micro_batches below 1 is a ValueError": [
            "test_bubble_fraction_refuses_empty_schedules"],
    },
}

# The hardware matrix of "a split model equals one device": cuda:0/cpu with one GPU, two GPUs.
DEVICE_PAIRS = [
    pytest.param(("cpu", "cpu"), id="cpu-cpu"),
    pytest.param(("cuda:0", "cpu"), id="cuda0-cpu",
                 marks=gpu_marks(1, "a model split across cuda:0 and the CPU")),
    pytest.param(("cuda:0", "cuda:1"), id="cuda0-cuda1",
                 marks=gpu_marks(2, "a model split across cuda:0 and cuda:1")),
]
# For the pipelined step the output must land on a GPU while the targets start on the CPU, so
# that forgetting to move the targets shows: cpu/cuda:0 instead of cuda:0/cpu.
PIPELINE_PAIRS = [
    pytest.param(("cpu", "cpu"), id="cpu-cpu"),
    pytest.param(("cpu", "cuda:0"), id="cpu-cuda0",
                 marks=gpu_marks(1, "a pipelined model split across the CPU and cuda:0")),
    pytest.param(("cuda:0", "cuda:1"), id="cuda0-cuda1",
                 marks=gpu_marks(2, "a pipelined model split across cuda:0 and cuda:1")),
]


@pytest.fixture(scope="module")
def ex():
    return load_exercise(LESSON)


@pytest.fixture(scope="module")
def train():
    return load_lesson_module(LESSON, "train")


@pytest.fixture(scope="module")
def sweep():
    return load_lesson_module(LESSON, "pipeline_sweep")


@pytest.fixture
def no_tf32():
    """Full fp32 matmuls while GPU results are compared with CPU ones (TF32 would round)."""
    with full_fp32():
        yield


# --------------------------------------------------------------------------------------------
# Small models whose stages carry parameters *and* buffers.


class Standardize(nn.Module):
    """A fixed per-feature shift and scale, kept in buffers: state that is not a parameter."""

    def __init__(self, features: int, g: torch.Generator):
        super().__init__()
        self.register_buffer("shift", torch.randn(features, generator=g))
        self.register_buffer("scale", torch.rand(features, generator=g) + 0.5)

    def forward(self, x):
        return (x - self.shift) / self.scale


IN_FEATURES, HIDDEN, OUT_FEATURES = 5, 16, 3


def make_stages(num_stages: int = 2, seed: int = 0) -> list[nn.Sequential]:
    """Consecutive stages of one MLP, on the CPU: 5 -> 16 -> ... -> 3 features."""
    g = torch.Generator().manual_seed(seed)
    widths = [IN_FEATURES] + [HIDDEN] * (num_stages - 1) + [OUT_FEATURES]
    stages = []
    for k in range(num_stages):
        layers = [Standardize(widths[k], g), nn.Linear(widths[k], widths[k + 1])]
        if k < num_stages - 1:
            layers.append(nn.Tanh())
        stage = nn.Sequential(*layers)
        with torch.no_grad():
            for p in stage.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        stages.append(stage)
    return stages


class Unsplit(nn.Module):
    """The same stages, run one after another on one device, with StagedModel's names."""

    def __init__(self, stages):
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, x):
        for stage in self.stages:
            x = stage(x)
        return x


def make_batch(batch_size: int, seed: int = 1, classes: bool = False):
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch_size, IN_FEATURES, generator=g)
    if classes:
        return inputs, torch.randint(0, OUT_FEATURES, (batch_size,), generator=g)
    return inputs, torch.randn(batch_size, OUT_FEATURES, generator=g)


def record_input_devices(stages) -> list[list[torch.device]]:
    """Hooks that note the device of every input each stage receives."""
    seen: list[list[torch.device]] = [[] for _ in stages]
    for k, stage in enumerate(stages):
        stage.register_forward_pre_hook(lambda _module, args, k=k: seen[k].append(args[0].device))
    return seen


def assert_gradients_equal(model, reference, what: str) -> None:
    try:
        assert_parameters_close(model, reference, what, grads=True)
    except AssertionError as err:
        if "is None" in str(err):
            raise AssertionError(
                f"{err}. Something between the stages cut the autograd graph: move "
                "activations with x.to(device), never with .detach(), .data or torch.tensor(x)"
            ) from None
        raise


def assert_refused(call, what: str, why: str) -> None:
    """``call()`` must raise ValueError; anything else fails with what happened instead."""
    try:
        result = call()
    except ValueError:
        return
    except Exception as err:
        if task_of(err):
            raise
        pytest.fail(f"{what} raised {type(err).__name__}: {err}; expected a ValueError ({why})")
    pytest.fail(f"{what} returned {result!r}; expected a ValueError ({why})")


# --------------------------------------------------------------------------------------------
# task2_1: place the stages, and the forward that carries activations between devices


@pytest.mark.task2_1
@pytest.mark.parametrize("devices", [("cpu", "meta"), ("meta", "cpu", "meta"),
                                     ("cpu", "cpu", "meta")])
def test_place_stages_puts_every_parameter_and_buffer_of_stage_k_on_device_k(ex, devices):
    stages = make_stages(len(devices))
    try:
        model = ex.place_stages(stages, list(devices))
    except Exception as err:
        if task_of(err):  # the untouched stub: reported as "not attempted yet"
            raise
        pytest.fail(
            f"place_stages(stages, {list(devices)}) raised {type(err).__name__}: "
            f"{str(err).splitlines()[0]}\nMove each whole stage with stage.to(device), which "
            "moves its parameters and its buffers (assigning param.data a tensor on another "
            "device does not work for every device, and leaves the buffers behind)"
        )
    assert isinstance(model, ex.StagedModel), (
        f"place_stages returned a {type(model).__name__}; return StagedModel(stages, devices)"
    )
    assert len(model.stages) == len(devices), (
        f"the placed model has {len(model.stages)} stages, expected {len(devices)}"
    )
    for k, (stage, device) in enumerate(zip(model.stages, devices, strict=True)):
        for kind, tensors in (("parameter", stage.named_parameters()),
                              ("buffer", stage.named_buffers())):
            for name, tensor in tensors:
                assert tensor.device == torch.device(device), (
                    f"stage {k}: {kind} {name!r} is on {tensor.device}, expected devices[{k}] = "
                    f"{device}. Move each whole stage with stage.to(device), which moves its "
                    "parameters and its buffers"
                )
    assert [str(d) for d in model.devices] == list(devices), (
        f"the placed model's devices are {model.devices}, expected {list(devices)}"
    )


@pytest.mark.task2_1
def test_place_stages_accepts_torch_devices_and_refuses_a_missing_device(ex):
    model = ex.place_stages(make_stages(2), [torch.device("cpu"), META])
    assert next(model.stages[1].parameters()).device == META
    assert_refused(lambda: ex.place_stages(make_stages(3), ["cpu", "cpu"]),
                   "place_stages(3 stages, 2 devices)", "one device per stage")
    assert_refused(lambda: ex.place_stages(make_stages(2), ["cpu", "cpu", "cpu"]),
                   "place_stages(2 stages, 3 devices)", "one device per stage")


@pytest.mark.task2_1
def test_place_stages_returns_a_model_whose_state_dict_holds_every_stage(ex):
    stages = make_stages(2)
    expected = [f"stages.{k}.{name}" for k, stage in enumerate(stages)
                for name in stage.state_dict()]
    model = ex.place_stages(stages, ["cpu", META])
    assert list(model.state_dict()) == expected, (
        f"the placed model's state_dict has keys {list(model.state_dict())}, expected "
        f"{expected}: return StagedModel(stages, devices), which keeps the moved stages in its "
        "nn.ModuleList 'stages' so that state_dict() and an optimizer see every stage"
    )
    assert all(a is b for a, b in zip(model.stages, stages, strict=True)), (
        "the placed model holds other modules than the stages it was given: move each stage "
        "in place with stage.to(device) and hold those"
    )


@pytest.mark.task2_1
# ("meta", "meta"): the batch itself, on the CPU, must be moved to stage 0's device.
@pytest.mark.parametrize("devices", [("cpu", "meta"), ("cpu", "cpu", "meta"), ("meta", "meta")])
def test_forward_moves_each_stage_input_to_that_stage_device(ex, devices):
    # Placed by the test, so that this checks your forward whatever place_stages does.
    stages = [stage.to(device) for stage, device in zip(make_stages(len(devices)), devices,
                                                         strict=True)]
    model = ex.StagedModel(stages, devices)
    seen = record_input_devices(stages)
    x = torch.randn(4, IN_FEATURES)  # on the CPU, as a data loader delivers it
    try:
        out = model(x)
    except Exception as err:
        if task_of(err):  # the untouched stub: reported as "not attempted yet"
            raise
        if seen[0] and seen[0][0] != torch.device(devices[0]):
            pytest.fail(
                f"stage 0 received the batch on {seen[0][0]}, expected devices[0] = "
                f"{devices[0]}, and then the forward raised {type(err).__name__}: "
                f"{str(err).splitlines()[0]}\nMove the batch to the first stage's device too, "
                "not only the activations between stages"
            )
        if all(received == [torch.device(d)] for received, d in zip(seen, devices, strict=True)):
            pytest.fail(
                f"every stage received its input on its own device {list(devices)}, but then "
                f"the forward raised {type(err).__name__}: {str(err).splitlines()[0]}\nLeave "
                f"the output where the last stage made it, on {devices[-1]}: the loss is "
                "computed there (moving it back to the first device is the caller's choice)"
            )
        pytest.fail(
            f"the forward raised {type(err).__name__}: {str(err).splitlines()[0]}\nInputs each "
            f"stage received: {[[str(d) for d in s] for s in seen]}; expected stage k's on "
            f"devices[k] = {list(devices)}, and the output left on {devices[-1]}. Move each "
            "stage's input to its device just before calling it"
        )
    for k, (received, device) in enumerate(zip(seen, devices, strict=True)):
        assert len(received) == 1, (
            f"stage {k} ran {len(received)} times in one forward, expected once"
        )
        assert received[0] == torch.device(device), (
            f"stage {k} received its input on {received[0]}, expected devices[{k}] = {device}"
        )
    assert out.device == torch.device(devices[-1]), (
        f"the output is on {out.device}, expected the last stage's device {devices[-1]} (leave "
        "it there: the loss is computed where the output is)"
    )
    assert tuple(out.shape) == (4, OUT_FEATURES), f"output shape {tuple(out.shape)}"


@pytest.mark.task2_1
@pytest.mark.parametrize("devices", DEVICE_PAIRS)
def test_split_model_equals_the_unsplit_model_on_one_device(ex, devices, no_tf32):
    stages = make_stages(2)
    reference = Unsplit(copy.deepcopy(stages))  # stays on the CPU
    model = ex.place_stages(stages, list(devices))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    split = f"split {devices[0]} -> {devices[1]}"
    for step in (1, 2):
        inputs, targets = make_batch(6, seed=step)
        optimizer.zero_grad()
        outputs = model(inputs)
        loss = F.mse_loss(outputs, targets.to(outputs.device))
        loss.backward()
        reference_optimizer.zero_grad()
        reference_outputs = reference(inputs)
        reference_loss = F.mse_loss(reference_outputs, targets)
        reference_loss.backward()

        assert_close(outputs, reference_outputs, f"step {step}: {split}: outputs vs one device")
        assert_close(loss, reference_loss, f"step {step}: {split}: loss vs one device")
        assert_gradients_equal(model, reference, f"step {step}: {split}")
        optimizer.step()
        reference_optimizer.step()
        assert_parameters_close(model, reference, f"after SGD step {step}: {split}: parameter")


# --------------------------------------------------------------------------------------------
# task2_2: a pipelined step over micro-batches, equal to the full batch


class Tap(torch.autograd.Function):
    """Identity in forward; notes in ``log`` when its backward runs."""

    @staticmethod
    def forward(ctx, x, log, label):
        ctx.log, ctx.label = log, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(("backward", ctx.label))
        return grad, None, None


class TwoStageNet(nn.Module):
    """Two stages on two devices that log every forward call and every backward through them."""

    def __init__(self, devices=("cpu", "cpu"), seed: int = 0):
        super().__init__()
        first, second = make_stages(2, seed)
        self.devices = [torch.device(d) for d in devices]
        self.first, self.second = first.to(self.devices[0]), second.to(self.devices[1])
        self.log: list[tuple[str, int]] = []
        self.inputs_seen: list[torch.Tensor] = []

    def forward(self, x):
        self.log.append(("forward", x.shape[0]))
        self.inputs_seen.append(x.detach().cpu())
        hidden = Tap.apply(self.first(x.to(self.devices[0])), self.log, x.shape[0])
        return self.second(hidden.to(self.devices[1]))


LOSSES = {"mse": F.mse_loss, "cross_entropy": F.cross_entropy}


def split_sizes(batch_size: int, m: int) -> list[int]:
    return [len(c) for c in torch.arange(batch_size).tensor_split(m)]


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
    inputs, targets = make_batch(10)
    assert_refused(lambda: ex.pipelined_step(TwoStageNet(), inputs, targets, F.mse_loss, m),
                   f"pipelined_step(num_micro_batches={m}) for a batch of 10",
                   "check 1 <= num_micro_batches <= batch size before splitting")


def assert_pipelined_training_matches(step_fn, batch_size: int, m: int, devices=("cpu", "cpu"),
                                      steps: int = 3) -> None:
    """``steps`` SGD steps with ``step_fn`` on m micro-batches equal full-batch training."""
    model, reference = TwoStageNet(devices), TwoStageNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.5)
    for step in range(1, steps + 1):
        inputs, targets = make_batch(batch_size, seed=100 + step)
        optimizer.zero_grad()
        loss = step_fn(model, inputs, targets, F.mse_loss, m)
        optimizer.step()
        reference_optimizer.zero_grad()
        expected = F.mse_loss(reference(inputs), targets)
        expected.backward()
        reference_optimizer.step()
        what = (f"after {step} SGD steps on batches of {batch_size} in {m} micro-batches "
                f"{split_sizes(batch_size, m)} on {devices[0]} -> {devices[1]}")
        assert_close(loss, expected.item(), f"{what}: loss")
        assert_parameters_close(model, reference, f"{what}: parameter")


@pytest.mark.task2_2
@pytest.mark.parametrize(("batch_size", "m"), [(8, 4), (10, 4), (10, 3)],
                         ids=["even", "uneven-4", "uneven-3"])
def test_pipelined_training_equals_full_batch_training(ex, batch_size, m):
    assert_pipelined_training_matches(ex.pipelined_step, batch_size, m)


@pytest.mark.task2_2
@pytest.mark.parametrize("devices", PIPELINE_PAIRS)
def test_pipelined_training_equals_full_batch_training_on_device_pairs(ex, devices, no_tf32):
    assert_pipelined_training_matches(ex.pipelined_step, 10, 3, devices=devices)


def naive_pipelined_step(model, inputs, targets, loss_fn, m):
    """The common mistake: every micro-batch's mean loss weighted by 1 / m."""
    total = 0.0
    for x, y in zip(inputs.tensor_split(m), targets.tensor_split(m), strict=True):
        loss = loss_fn(model(x), y) / m
        loss.backward()
        total += loss.item()
    return total


def test_the_training_check_catches_a_naive_one_over_m_scaling():
    # With equal micro-batches, 1/m *is* size/B: the naive scaling passes...
    assert_pipelined_training_matches(naive_pipelined_step, 8, 4)
    # ...and with unequal ones it must be caught, or the check above proves nothing.
    with pytest.raises(AssertionError, match="after 1 SGD steps"):
        assert_pipelined_training_matches(naive_pipelined_step, 10, 4)


# --------------------------------------------------------------------------------------------
# task2_3: the bubble fraction, against a step-by-step simulation of GPipe's schedule


def simulate_gpipe(num_stages: int, num_micro_batches: int):
    """GPipe on a grid of time steps: returns (idle fraction, grid).

    ``grid[s][t]`` is ``("F", i)``, ``("B", i)`` or None (idle). Forward: stage s runs
    micro-batch i at step s + i. Backward, once every forward is done: the last stage first,
    stage s runs micro-batch i's backward at step T + (p - 1 - s) + i, T the forward phase's
    length. Every slot is one unit of work (a forward or a backward of one micro-batch on one
    stage); the dependencies are checked, then the idle slots are counted.
    """
    p, m = num_stages, num_micro_batches
    phase = m + p - 1
    grid = [[None] * (2 * phase) for _ in range(p)]
    when = {}
    for s in range(p):
        for i in range(m):
            for kind, t in (("F", s + i), ("B", phase + (p - 1 - s) + i)):
                assert grid[s][t] is None, "two jobs in one slot"
                grid[s][t] = (kind, i)
                when[kind, s, i] = t
    for s in range(p):
        for i in range(m):
            if s > 0:
                assert when["F", s, i] > when["F", s - 1, i], "a stage ran before its input"
            if s < p - 1:
                assert when["B", s, i] > when["B", s + 1, i], "a backward before its gradient"
            assert when["B", s, i] > max(when["F", q, j] for q in range(p) for j in range(m))
    idle = sum(slot is None for row in grid for slot in row)
    return idle / (p * 2 * phase), grid


@pytest.mark.task2_3
@pytest.mark.parametrize("num_stages", range(1, 9))
def test_bubble_fraction_matches_a_simulated_gpipe_schedule(ex, num_stages):
    for m in range(1, 17):
        got = ex.bubble_fraction(num_stages, m)
        expected, _ = simulate_gpipe(num_stages, m)
        assert isinstance(got, float), (
            f"bubble_fraction({num_stages}, {m}) returned a {type(got).__name__}, expected a "
            "Python float"
        )
        slots = 2 * num_stages * (m + num_stages - 1)
        assert math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12), (
            f"bubble_fraction(num_stages={num_stages}, num_micro_batches={m}) = {got:.6g}; the "
            f"simulated schedule is idle {expected:.6g} of the time ({round(expected * slots)} "
            f"of {slots} stage-steps). Count the forward phase: how many steps does it take, "
            "and for how many of them is each stage busy?"
        )


@pytest.mark.task2_3
@pytest.mark.parametrize(("num_stages", "m"), [(0, 4), (4, 0), (-1, 2), (2, -3)])
def test_bubble_fraction_refuses_empty_schedules(ex, num_stages, m):
    assert_refused(lambda: ex.bubble_fraction(num_stages, m),
                   f"bubble_fraction({num_stages}, {m})", "a schedule needs p >= 1 and m >= 1")


# --------------------------------------------------------------------------------------------
# The lesson's claims, checked on its own scripts


def test_the_naive_split_keeps_one_device_busy_at_a_time():
    for p in range(1, 9):
        idle, grid = simulate_gpipe(p, 1)
        assert math.isclose(1 - idle, 1 / p), f"{p} stages, 1 micro-batch: utilisation {1 - idle}"
        busy_per_step = [sum(grid[s][t] is not None for s in range(p)) for t in range(2 * p)]
        assert busy_per_step == [1] * (2 * p), busy_per_step


def test_the_scripts_bubble_fraction_is_the_simulated_one(sweep):
    for p in range(1, 7):
        for m in range(1, 13):
            assert math.isclose(sweep.bubble_fraction(p, m), simulate_gpipe(p, m)[0])
            assert math.isclose(sweep.ideal_speedup(p, m),
                                (1 - simulate_gpipe(p, m)[0]) / (1 - simulate_gpipe(p, 1)[0]))


def test_readme_bubble_table_matches_the_formula():
    readme = (LESSONS_DIR / LESSON / "README.md").read_text()
    rows = re.findall(r"^\| p = (\d+) \|(.+)\|$", readme, flags=re.MULTILINE)
    header = re.search(r"^\| stages \\ micro-batches \|(.+)\|$", readme, flags=re.MULTILINE)
    assert rows and header, "the README's bubble table is missing"
    ms = [int(cell.strip().removeprefix("m = ")) for cell in header.group(1).split("|")]
    for p, cells in rows:
        for m, cell in zip(ms, cells.split("|"), strict=True):
            expected = (int(p) - 1) / (m + int(p) - 1)
            assert cell.strip() == f"{expected:.0%}", f"p={p}, m={m}: {cell} vs {expected:.0%}"


# train.py: lesson 00's GPT training with the blocks split across two devices


@pytest.fixture(scope="module")
def gpt_data():
    """The running example's windows, cut down: 40 to train on (a few steps), 24 to evaluate."""
    dataset = CharDataset(SIZES["tiny"]["block_size"])
    train_set, val_set = train_val_split(dataset)
    return dataset, Subset(train_set, range(40)), Subset(val_set, range(24))


@pytest.fixture
def one_thread():
    """One CPU thread, as the script runs: the tiny model's matrices are too small to share."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make_gpt(vocab_size: int, **overrides) -> GPT:
    """The script's model, built on the CPU from seed 0: the same weights every time."""
    return GPT(GPTConfig.named("tiny", vocab_size=vocab_size, **overrides), seed=0)


class Crossed(Exception):
    """Raised to end a forward once the activations have crossed to the second device."""


def stop():
    raise Crossed


@pytest.mark.parametrize("n_layer", [2, 4, 6])
def test_train_py_split_across_puts_each_half_on_its_device(train, gpt_data, n_layer):
    dataset = gpt_data[0]
    model = make_gpt(dataset.vocab_size, n_layer=n_layer)
    assert train.split_across(model, (torch.device("cpu"), META)) is model, (
        "split_across should move the model's parts in place and return the model")
    half = n_layer // 2
    first = ("tok_emb.", "pos_emb.", *(f"blocks.{i}." for i in range(half)))
    where = {name: p.device for name, p in model.named_parameters()}
    for name, device in where.items():
        expected = torch.device("cpu") if name.startswith(first) else META
        assert device == expected, (
            f"{n_layer} blocks split across cpu and meta: {name!r} is on {device}, expected "
            f"{expected} (embeddings and blocks 0-{half - 1} first, the rest with ln_f and "
            f"lm_head second)\n{where}")

    # Where each block receives its input, up to the first block on meta: the meta device shows
    # that the activations arrive there, and stopping then skips computing on meta (its
    # LayerNorm alone takes seconds to set up).
    received = []
    for k, block in enumerate(model.blocks[:half + 1]):  # after split_across's own hook
        block.register_forward_pre_hook(
            lambda _module, args, k=k: received.append((k, args[0].device, args[0].requires_grad)))
    model.blocks[half].register_forward_pre_hook(lambda _module, _args: stop())
    idx = torch.zeros(2, 8, dtype=torch.long)  # token ids on the CPU, as a batch arrives
    with pytest.raises(Crossed):
        model(idx)
    expected = [(k, torch.device("cpu"), True) for k in range(half)] + [(half, META, True)]
    assert received == expected, (
        f"(block, device of its input, requires_grad) in one forward: {received}, expected "
        f"{expected}. Before block {half}, move the activations to the second device with "
        "x.to(device), which autograd records (never .detach() them)")


def reference_epoch(model, batches, optimizer) -> float:
    """Lesson 00's training step, written out: the whole model and every batch on the CPU."""
    loss_sum, seen = 0.0, 0
    for inputs, targets in batches:
        logits, _ = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_sum, seen = loss_sum + loss.item() * len(inputs), seen + len(inputs)
    return loss_sum / seen


# (micro-batches, batch size): 40 windows are batches of 16, 16, 8 or four of 10. torch.chunk
# cuts 10 into 4, 4, 2 (M = 3) and 3, 3, 3, 1 (M = 4): pieces of unequal size.
MICRO_BATCH_CASES = [pytest.param(1, 16, id="m1-batch16"), pytest.param(2, 16, id="m2-batch16"),
                     pytest.param(3, 10, id="m3-batch10"), pytest.param(4, 10, id="m4-batch10")]


@pytest.mark.parametrize("devices", DEVICE_PAIRS)
@pytest.mark.parametrize(("micro_batches", "batch_size"), MICRO_BATCH_CASES)
def test_train_py_split_training_equals_one_device(train, gpt_data, devices, micro_batches,
                                                   batch_size, no_tf32, one_thread):
    dataset, train_set, val_set = gpt_data
    devices = tuple(map(torch.device, devices))
    model = train.split_across(make_gpt(dataset.vocab_size), devices)
    reference = make_gpt(dataset.vocab_size)  # one device: the CPU
    # SGD with momentum: the update is linear in the gradient, so any wrong weighting shows.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    loader, _ = train.make_loaders(train_set, val_set, batch_size, seed=0, device=devices[0])
    what = (f"{devices[0]} -> {devices[1]}, {micro_batches} micro-batch(es) of batches of "
            f"{batch_size}")
    hint = ("" if micro_batches == 1 else "\nEach piece's mean loss must weigh len(x) / "
            "len(inputs): 1 / M is right only when M divides the batch")
    for epoch in (1, 2):
        batches = list(loader)  # the same shuffled order for both
        got = train.train_one_epoch(model, batches, optimizer, devices,
                                    micro_batches=micro_batches)
        expected = reference_epoch(reference, batches, reference_optimizer)
        try:
            assert_parameters_close(model, reference, f"after epoch {epoch} ({len(batches)} "
                                    f"SGD steps): {what}: parameter")
            assert_close(got, expected, f"epoch {epoch}: {what}: mean training loss",
                         rtol=1e-5, atol=1e-6)
        except AssertionError as err:
            raise AssertionError(f"{err}{hint}") from None
    if micro_batches == 1 and devices[0] == devices[1] == torch.device("cpu"):
        # The same operations in the same order: not close, identical, as lesson 00's run.
        assert parameter_digest(model) == parameter_digest(reference), (
            f"{what}: the parameters are close to one device's but not bit for bit the same")


@pytest.mark.parametrize("devices", DEVICE_PAIRS)
def test_train_py_evaluates_a_split_model_like_one_device(train, gpt_data, devices, no_tf32,
                                                          one_thread):
    dataset, train_set, val_set = gpt_data
    devices = tuple(map(torch.device, devices))
    model = train.split_across(make_gpt(dataset.vocab_size), devices)
    reference = make_gpt(dataset.vocab_size)
    _, val_loader = train.make_loaders(train_set, val_set, 10, seed=0, device=devices[0])
    # gpt.run's evaluate: the batch goes in on the first device, the targets meet the logits on
    # the second.
    loss, accuracy = run.evaluate(model, val_loader, devices[0])  # batches of 10, 10, 4
    inputs, targets = (torch.stack(t) for t in zip(*val_set, strict=True))
    with torch.no_grad():
        logits, expected_loss = reference(inputs, targets)
    split = f"{devices[0]} -> {devices[1]}"
    assert_close(loss, expected_loss.item(), f"{split}: validation loss", rtol=1e-5, atol=1e-6)
    assert_close(accuracy, (logits.argmax(-1) == targets).float().mean().item(),
                 f"{split}: validation accuracy", rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("gpus", "expected"), [(0, ["cpu", "cpu"]), (1, ["cuda:0", "cpu"]),
                                                (2, ["cuda:0", "cuda:1"]),
                                                (4, ["cuda:0", "cuda:1"])])
def test_the_scripts_pick_the_best_device_pair(train, sweep, monkeypatch, gpus, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    for script in (train, sweep):
        pair = script.pick_device_pair()
        assert isinstance(pair, tuple) and all(isinstance(d, torch.device) for d in pair), (
            f"{script.__name__}.pick_device_pair() returned {pair!r}, expected a tuple of two "
            "torch.device")
        assert pair == tuple(torch.device(d) for d in expected), (script.__name__, pair)


@pytest.mark.parametrize("devices", ["cpu", "cpu,cpu,cpu"])
def test_train_py_refuses_anything_but_two_devices_in_one_line(train, capsys, devices):
    code = train.main(["--devices", devices])
    err = capsys.readouterr().err.strip()
    assert code == 2, f"--devices {devices}: exit code {code}, expected 2 (bad usage)"
    assert len(err.splitlines()) == 1 and "Traceback" not in err, f"expected one line:\n{err}"
    assert "expected two" in err and "cuda:0,cuda:1" in err, err


def test_the_sweeps_gpipe_step_trains_like_the_full_batch(sweep):
    devices = [torch.device("cpu")] * 2
    stages = sweep.build_stages(8, 4, devices)
    reference = nn.Sequential(*copy.deepcopy(stages))
    optimizer = torch.optim.SGD([p for s in stages for p in s.parameters()], lr=0.1,
                                momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(3)
    for step in (1, 2, 3):
        inputs, targets = torch.randn(10, 8, generator=g), torch.randn(10, 8, generator=g)
        optimizer.zero_grad()
        loss = sweep.gpipe_step(stages, devices, inputs, targets, 4)  # 3, 3, 2, 2
        optimizer.step()
        reference_optimizer.zero_grad()
        expected = F.mse_loss(reference(inputs), targets)
        expected.backward()
        reference_optimizer.step()
        assert_close(loss, expected.detach(), f"gpipe_step loss at step {step}")
        got = {f"{k}.{n}": p for k, s in enumerate(stages) for n, p in s.named_parameters()}
        assert_parameters_close(got, dict(reference.named_parameters()),
                                f"after {step} SGD steps, gpipe_step with 4 micro-batches")


def test_the_sweeps_gpipe_step_follows_the_clock_schedule(sweep):
    devices = [torch.device("cpu")] * 3
    stages = sweep.build_stages(8, 3, devices)
    order = []
    for k, stage in enumerate(stages):
        stage.register_forward_pre_hook(lambda _m, _args, k=k: order.append(k))
    inputs = torch.randn(6, 8)
    sweep.gpipe_step(stages, devices, inputs, torch.randn(6, 8), 3)
    # Clock t runs stage s on micro-batch t - s: (0), (1, 0), (2, 1, 0) by micro-batch...
    expected = [s for t in range(3 + 3 - 1) for s in range(3) if 0 <= t - s < 3]
    assert order == expected, f"stages ran in the order {order}, expected {expected}"


def test_batchnorm_breaks_the_micro_batch_equivalence(sweep):
    """The README's caveat: in training mode BatchNorm normalises each micro-batch by its own
    statistics, so micro-batching changes the result (LayerNorm does not)."""
    devices = [torch.device("cpu")] * 2
    g = torch.Generator().manual_seed(4)
    inputs, targets = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
    for norm, equal in ((nn.BatchNorm1d, False), (nn.LayerNorm, True)):
        torch.manual_seed(0)
        stages = [nn.Sequential(nn.Linear(6, 6), norm(6)), nn.Sequential(nn.Linear(6, 6))]
        whole = copy.deepcopy(stages)
        loss_micro = sweep.gpipe_step(stages, devices, inputs, targets, 4)
        loss_whole = sweep.gpipe_step(whole, devices, inputs, targets, 1)
        assert torch.allclose(loss_micro, loss_whole) == equal, (norm.__name__, loss_micro,
                                                                 loss_whole)


# --------------------------------------------------------------------------------------------
# The scripts run, and print what the README says


# Both scripts are started together, once, when the first of their tests asks: each spends
# most of its time importing torch, and two cores do that for both at once.
SCRIPT_RUNS = {
    # An epoch over the first 480 windows: 30 steps, enough for the loss to fall clearly.
    "train.py": ["--epochs", "1", "--train-windows", "480", "--micro-batches", "2"],
    "pipeline_sweep.py": ["--width", "16", "--blocks", "4", "--batch-size", "30",
                          "--micro-batches", "1,2,4,64", "--steps", "2"],
}


@pytest.fixture(scope="module")
def script_runs():
    runs = {name: start_script(LESSONS_DIR / LESSON / name, *args)
            for name, args in SCRIPT_RUNS.items()}
    yield runs
    for launched in runs.values():
        launched.stop()


start_launches_first = start_first("script_runs")  # while the other checks run


def script_output(script_runs, name: str) -> tuple[str, dict]:
    """The output of ``name`` (started by the fixture) and the JSON it wrote to --result."""
    run = script_runs[name].result()
    return run.output, run.data


def expected_pair() -> list[str]:
    gpus = cuda_device_count()
    return ["cuda:0", "cuda:1"] if gpus >= 2 else ["cuda:0", "cpu"] if gpus else ["cpu", "cpu"]


@pytest.mark.slow
def test_train_py_trains_the_split_gpt_and_prints_where_it_is(script_runs):
    out, data = script_output(script_runs, "train.py")
    first, second = expected_pair()
    assert re.search(rf"^device {first} \(blocks 0-1; the rest on {second}, 2 micro-batch\(es\)\)",
                     out, flags=re.MULTILINE), out
    assert "epoch 1/1" in out and "parameters sha256" in out, out
    assert data["devices"] == [first, second], data["devices"]
    assert data["micro_batches"] == 2
    # From the untrained model's loss, about ln(vocab size), down over the epoch and below it.
    start = math.log(CharDataset(SIZES["tiny"]["block_size"]).vocab_size)
    [train_loss], [val_loss] = data["train_loss"], data["val_loss"]
    assert val_loss < train_loss < start - 0.5, (
        f"untrained ~{start:.3f} (ln of the vocabulary), mean training loss {train_loss:.4f}, "
        f"validation loss after the epoch {val_loss:.4f}: expected each below the one before")
    assert re.fullmatch(r"[0-9a-f]{64}", data["params_sha256"]), data["params_sha256"]
    assert data["params_sha256"][:16] in out, "the printed digest is the one in the result"


@pytest.mark.slow
def test_pipeline_sweep_prints_a_row_per_micro_batch_count(script_runs):
    out, data = script_output(script_runs, "pipeline_sweep.py")
    first, second = expected_pair()
    assert f"2 stages on {first} -> {second}" in out, out
    rows = data["rows"]
    assert [row["micro_batches"] for row in rows] == [1, 2, 4], "m=64 > batch 30 is dropped"
    assert [f"{row['bubble']:.1%}" for row in rows] == ["50.0%", "33.3%", "20.0%"]
    for row in rows:
        assert row["step_ms"] > 0
        assert row["grad_max_diff"] < 1e-5, f"m={row['micro_batches']}: gradients differ"
        assert re.search(rf"^ +{row['micro_batches']} +{row['micro_batch_size']} +[\d.]+ ", out,
                         flags=re.MULTILINE), out
    if first == second == "cpu":
        assert "One device executes the stages one after another" in out, out
        assert "CUDA kernels are queued asynchronously on each device" in out, out


def test_pipeline_sweep_plot_needs_matplotlib_only_when_asked(sweep, tmp_path, monkeypatch,
                                                              capsys):
    path = tmp_path / "sweep.png"
    args = ["--devices", "cpu,cpu", "--width", "8", "--blocks", "2", "--batch-size", "4",
            "--micro-batches", "1,2", "--steps", "1", "--plot", str(path)]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        available = False
    else:
        available = True
    if available:
        assert sweep.main(args) == 0
        assert path.stat().st_size > 0, "no plot was written"
    # Without matplotlib (imitated when it is installed), --plot is refused in one line, at once.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    capsys.readouterr()
    assert sweep.main(args) == 2
    captured = capsys.readouterr()
    assert "--plot needs matplotlib" in captured.err and "pip install matplotlib" in captured.err
    assert captured.out == "", "the sweep should not run when the plot cannot be drawn"
