"""What the test files of lesson 02 share: the device pairs a split runs on, small models whose
stages carry parameters and buffers, a two-stage net that logs its forwards and backwards, the
check that a pipelined step trains like the full batch, and GPipe's schedule simulated step by
step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.compare import assert_close, assert_parameters_close
from harness.exercises import task_of
from harness.hardware import gpu_marks

LESSON = "02_model_parallel"
META = torch.device("meta")  # tensors with a shape and no data: where a tensor is, made visible

# The hardware matrix of "a split model equals one device": cuda:0/cpu with one GPU, two GPUs.
DEVICE_PAIRS = [
    pytest.param(("cpu", "cpu"), id="cpu-cpu"),
    pytest.param(("cuda:0", "cpu"), id="cuda0-cpu",
                 marks=gpu_marks(1, "a model split across cuda:0 and the CPU")),
    pytest.param(("cuda:0", "cuda:1"), id="cuda0-cuda1",
                 marks=gpu_marks(2, "a model split across cuda:0 and cuda:1")),
]


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


def make_batch(batch_size: int, seed: int = 1, classes: bool = False):
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch_size, IN_FEATURES, generator=g)
    if classes:
        return inputs, torch.randint(0, OUT_FEATURES, (batch_size,), generator=g)
    return inputs, torch.randn(batch_size, OUT_FEATURES, generator=g)


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
# Pipelined steps over micro-batches (task2_2, and the lesson's check of its grader)


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


def split_sizes(batch_size: int, m: int) -> list[int]:
    return [len(c) for c in torch.arange(batch_size).tensor_split(m)]


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


# --------------------------------------------------------------------------------------------
# GPipe's schedule, simulated (task2_3, and the lesson's claims about the bubble)


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
