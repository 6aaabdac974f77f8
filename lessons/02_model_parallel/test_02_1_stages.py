"""Grades task2_1, place_stages and StagedModel's forward: every stage, its parameters and its
buffers, on its own device; each stage's input moved there; the split model trains exactly like
the unsplit one on one device.

    pytest lessons/02_model_parallel -m task2_1

Without a GPU, the splits run on ``cpu``/``cpu`` (the numbers) and on ``cpu``/``meta`` (where
things live); the ``cuda:0``/``cpu`` and ``cuda:0``/``cuda:1`` checks skip with the hardware they
need.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.compare import assert_close, assert_parameters_close
from harness.exercises import task_of
from lesson02.common import (
    DEVICE_PAIRS,
    IN_FEATURES,
    META,
    OUT_FEATURES,
    assert_gradients_equal,
    assert_refused,
    make_batch,
    make_stages,
)

# This task's contract, clause by clause, and the tests that fail when only that clause
# is broken (tests/test_course.py checks the names).
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
}


class Unsplit(nn.Module):
    """The same stages, run one after another on one device, with StagedModel's names."""

    def __init__(self, stages):
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, x):
        for stage in self.stages:
            x = stage(x)
        return x


def record_input_devices(stages) -> list[list[torch.device]]:
    """Hooks that note the device of every input each stage receives."""
    seen: list[list[torch.device]] = [[] for _ in stages]
    for k, stage in enumerate(stages):
        stage.register_forward_pre_hook(lambda _module, args, k=k: seen[k].append(args[0].device))
    return seen


@pytest.mark.task2_1
@pytest.mark.parametrize("devices", [("cpu", "meta"), ("meta", "cpu", "meta"),
                                     ("cpu", "cpu", "meta")])
def test_place_stages_puts_every_parameter_and_buffer_of_stage_k_on_device_k(ex, devices):
    """place_stages returns a StagedModel whose stage k has every parameter and buffer on
    devices[k], given as strings: on cpu/meta, meta/cpu/meta and cpu/cpu/meta, where two stages
    share a device."""
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
    """place_stages takes torch.device objects (cpu, meta) as well as strings, and refuses 3 stages
    on 2 devices and 2 stages on 3 with a ValueError."""
    model = ex.place_stages(make_stages(2), [torch.device("cpu"), META])
    assert next(model.stages[1].parameters()).device == META
    assert_refused(lambda: ex.place_stages(make_stages(3), ["cpu", "cpu"]),
                   "place_stages(3 stages, 2 devices)", "one device per stage")
    assert_refused(lambda: ex.place_stages(make_stages(2), ["cpu", "cpu", "cpu"]),
                   "place_stages(2 stages, 3 devices)", "one device per stage")


@pytest.mark.task2_1
def test_place_stages_returns_a_model_whose_state_dict_holds_every_stage(ex):
    """The model place_stages returns (on cpu/meta) holds the very stage modules it was given, and
    its state_dict has every stage's keys, in order, as stages.k.name."""
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
    """StagedModel's forward gives each stage its input once, on that stage's device (the CPU batch
    included), and leaves the output on the last one: stages placed by the test on cpu/meta,
    cpu/cpu/meta and meta/meta."""
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
    """A model split by place_stages into 2 stages gives the unsplit CPU model's outputs, loss and
    gradients, and its parameters after each of 2 SGD steps (momentum 0.9), to fp32 tolerance with
    TF32 off: on cpu/cpu, on cuda:0/cpu with a GPU, on cuda:0/cuda:1 with two."""
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
