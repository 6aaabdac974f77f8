"""Split one model across two devices by hand, and train it.

    python lessons/02_model_parallel/split_model.py            # the best pair this machine has
    python lessons/02_model_parallel/split_model.py --devices cpu,cpu --steps 5
    python lessons/02_model_parallel/split_model.py --width 8192 --depth 8 --batch-size 4096

The first half of an MLP goes on one device and the second half on another; the forward moves
the batch to the first device and the activations to the second, and autograd carries the
gradients back the same way. The pair is the best this machine has: ``cuda:0`` and ``cuda:1``,
else ``cuda:0`` and the CPU, else the CPU twice (the mechanics are the same; only the speed
differs). The script prints where every parameter lives, then trains a few steps on one fixed
batch and prints the loss and the time of each step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

WARMUP_STEPS = 1  # not averaged: the first step pays for allocation and kernel selection


def pick_device_pair() -> tuple[torch.device, torch.device]:
    """Two GPUs if there are two, else one GPU and the CPU, else the CPU twice."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= 2:
        return torch.device("cuda:0"), torch.device("cuda:1")
    if gpus == 1:
        return torch.device("cuda:0"), torch.device("cpu")
    return torch.device("cpu"), torch.device("cpu")


def build_mlp(width: int, depth: int) -> nn.Sequential:
    """``depth`` Linear(width, width) layers with a ReLU between each two, built on the CPU."""
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if i < depth - 1:
            # He initialisation keeps the signal's size through many ReLU layers.
            nn.init.kaiming_normal_(layers[-1].weight, nonlinearity="relu")
            nn.init.zeros_(layers[-1].bias)
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def make_batch(batch_size: int, width: int, seed: int = 1):
    """One fixed batch: random inputs, and targets from a fixed random "teacher" layer."""
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch_size, width, generator=g)
    teacher = torch.randn(width, width, generator=g) / width**0.5
    return inputs, torch.tanh(inputs @ teacher)


class TwoDeviceModel(nn.Module):
    """The seed's "Method 2", made general: the first layers on one device, the rest on another.

    ``layers`` is cut after its ``split_at``-th module (by default, halfway through its Linear
    layers). The two halves are moved in place, so ``layers`` itself is split as well.
    """

    def __init__(self, layers: nn.Sequential, devices: tuple[torch.device, torch.device],
                 split_at: int | None = None):
        super().__init__()
        if split_at is None:
            linears = [i for i, m in enumerate(layers) if isinstance(m, nn.Linear)]
            split_at = linears[len(linears) // 2] if len(linears) > 1 else len(layers)
        self.devices = tuple(torch.device(d) for d in devices)
        self.stage0 = layers[:split_at].to(self.devices[0])
        self.stage1 = layers[split_at:].to(self.devices[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stage0(x.to(self.devices[0]))
        # The copy is recorded by autograd: in backward, the gradient of x travels back to
        # devices[0]. Until it arrives, stage0's device has nothing to do (and stage1's device
        # had nothing to do while stage0 ran).
        return self.stage1(x.to(self.devices[1]))


def sync(devices) -> None:
    """Wait for every queued kernel: CUDA work runs asynchronously to Python."""
    for device in set(devices):
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def megabytes(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:,.1f} MB"


def describe_placement(model: nn.Module, log=print) -> dict[str, str]:
    """Print (and return) the device of every parameter, and the weight bytes on each device."""
    where: dict[str, str] = {}
    per_device: dict[str, int] = {}
    for name, param in model.named_parameters():
        where[name] = str(param.device)
        per_device[str(param.device)] = (per_device.get(str(param.device), 0)
                                         + param.numel() * param.element_size())
        log(f"  {name:<18} {str(tuple(param.shape)):<14} on {param.device}")
    for device, n_bytes in per_device.items():
        log(f"  weights on {device}: {megabytes(n_bytes)}")
    return where


def train(model: TwoDeviceModel, inputs: torch.Tensor, targets: torch.Tensor, steps: int,
          lr: float, log=print) -> tuple[list[float], list[float]]:
    """SGD steps on one fixed batch; returns the losses and the seconds of each step."""
    # One optimizer for parameters on two devices: it updates each where it lives.
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    # The loss is computed where the output is: the targets go to the last stage's device.
    targets = targets.to(model.devices[1])
    losses, seconds = [], []
    for step in range(1, steps + 1):
        sync(model.devices)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        sync(model.devices)  # stop the clock only when both devices have finished
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
        log(f"step {step}/{steps}  loss {losses[-1]:.5f}  {seconds[-1] * 1000:8.1f} ms")
    return losses, seconds


def parse_devices(text: str) -> tuple[torch.device, torch.device]:
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected two devices like cuda:0,cuda:1, got {text!r}")
    try:
        return torch.device(parts[0]), torch.device(parts[1])
    except RuntimeError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=parse_devices, default=None,
                        help="two devices, e.g. cuda:0,cuda:1 (default: the best pair available)")
    parser.add_argument("--width", type=int, default=None,
                        help="features per layer (default 4096 on two GPUs, else 512)")
    parser.add_argument("--depth", type=int, default=8, help="Linear layers (default 8)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="samples per step (default 4096 on two GPUs, else 256)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--result", type=Path, help="write the result as JSON to this path")
    args = parser.parse_args(argv)

    devices = args.devices or pick_device_pair()
    # A stage on the CPU sets the pace, so the CPU sizes unless both stages are on GPUs.
    on_gpu = all(d.type == "cuda" for d in devices)
    width = args.width or (4096 if on_gpu else 512)
    batch_size = args.batch_size or (4096 if on_gpu else 256)
    if min(width, args.depth, batch_size, args.steps) < 1:
        parser.error("--width, --depth, --batch-size and --steps must be at least 1")

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"torch {torch.__version__}, {gpus} CUDA GPU(s); stages on {devices[0]} -> "
          f"{devices[1]}")
    if devices[0] == devices[1]:
        print("  (one device plays both parts: the mechanics are the same, the speed is not)")
    if devices[0].type == devices[1].type == "cuda":
        peer = torch.cuda.can_device_access_peer(devices[0], devices[1])
        print(f"  peer-to-peer copies {devices[0]} -> {devices[1]}: "
              f"{'yes' if peer else 'no (copies go through host memory)'}")

    torch.manual_seed(0)  # the same initial weights on every machine
    model = TwoDeviceModel(build_mlp(width, args.depth), devices)
    inputs, targets = make_batch(batch_size, width)

    print(f"where each parameter lives ({args.depth} layers of width {width}):")
    where = describe_placement(model)
    boundary = batch_size * width * 4
    print(f"crossing between the stages every step: the activations forward and their gradient "
          f"backward, {megabytes(boundary)} each")

    # The batch starts on the first stage's device, as a data loader would deliver it there.
    losses, seconds = train(model, inputs.to(devices[0]), targets, args.steps, args.lr)
    timed = seconds[WARMUP_STEPS:] or seconds
    # The median: one step slowed down by another program on the machine does not move it.
    step_ms = 1000 * statistics.median(timed)
    warmup = f", first {WARMUP_STEPS} excluded as warm-up" if len(seconds) > WARMUP_STEPS else ""
    print(f"step time {step_ms:.1f} ms (median of {len(timed)}{warmup}); "
          f"loss {losses[0]:.5f} -> {losses[-1]:.5f}")

    if args.result is not None:
        result = {"devices": [str(d) for d in devices], "width": width, "depth": args.depth,
                  "batch_size": batch_size, "parameter_devices": where, "losses": losses,
                  "step_seconds": seconds, "step_ms": step_ms, "torch": torch.__version__}
        args.result.parent.mkdir(parents=True, exist_ok=True)
        args.result.write_text(json.dumps(result, indent=2) + "\n")
        print(f"result written to {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
