"""Pipeline micro-batches through a model split across devices, and time each number of them.

    python lessons/02_model_parallel/pipeline_sweep.py              # the best pair this machine has
    python lessons/02_model_parallel/pipeline_sweep.py --micro-batches 1,2,4,8 --steps 5
    python lessons/02_model_parallel/pipeline_sweep.py --plot sweep.png   # needs matplotlib

The model is cut into one stage per device (by default ``cuda:0`` and ``cuda:1``, else ``cuda:0``
and the CPU, else the CPU twice). Each training step splits the batch into ``m`` micro-batches
and runs GPipe's schedule: at clock ``t`` stage ``s`` runs the forward of micro-batch ``t - s``;
when every forward is done, one backward runs through all of them, and the optimizer steps.
``m = 1`` is the naive split (``train.py`` without ``--micro-batches``). For each ``m`` the
script prints the step time, the bubble fraction ``(p - 1) / (m + p - 1)`` of ``p`` stages, the
speed-up that bubble allows over ``m = 1`` if the stages really overlap, and how far the
gradients are from ``m = 1``'s (they should agree to float rounding: the micro-batch losses are
weighted by their sizes).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
from gpt import run  # noqa: E402  the plumbing every step shares: lessons/gpt/run.py

WARMUP_STEPS = 1  # per m, not timed: the first step at a new size allocates and picks kernels


def pick_device_pair() -> tuple[torch.device, torch.device]:
    """Two GPUs if there are two, else one GPU and the CPU, else the CPU twice."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    pair = ("cuda:0", "cuda:1") if gpus >= 2 else ("cuda:0", "cpu") if gpus == 1 else ("cpu", "cpu")
    return torch.device(pair[0]), torch.device(pair[1])


def build_stages(width: int, depth: int, devices: Sequence[torch.device]) -> list[nn.Sequential]:
    """An MLP of ``depth`` Linear layers, cut into one stage per device and moved there."""
    torch.manual_seed(0)  # the same initial weights on every machine
    layers: list[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if i < depth - 1:
            nn.init.kaiming_normal_(layers[-1].weight, nonlinearity="relu")
            nn.init.zeros_(layers[-1].bias)
            layers.append(nn.ReLU())
    # Cut between Linear layers, as evenly as the layer count allows.
    linears = [i for i, m in enumerate(layers) if isinstance(m, nn.Linear)]
    cuts = [linears[len(linears) * k // len(devices)] for k in range(len(devices))] + [len(layers)]
    return [nn.Sequential(*layers[cuts[k]:cuts[k + 1]]).to(device)
            for k, device in enumerate(devices)]


def gpipe_step(stages: list[nn.Module], devices: Sequence[torch.device], inputs: torch.Tensor,
               targets: torch.Tensor, num_micro_batches: int) -> torch.Tensor:
    """Forward and backward of one batch in ``num_micro_batches`` pieces, in GPipe's order.

    Returns the full batch's mean loss (a tensor on the last device). The gradients equal those
    of ``F.mse_loss`` on the whole batch: each micro-batch's mean loss is weighted by its share
    of the batch, which is not ``1 / m`` when ``m`` does not divide the batch.
    """
    batch_size, num_stages = inputs.shape[0], len(stages)
    activations = list(inputs.tensor_split(num_micro_batches))
    micro_targets = targets.tensor_split(num_micro_batches)
    # Clock t: stage s works on micro-batch t - s, if there is one. On GPUs each call only
    # queues kernels on its stage's device and returns at once, so within one clock every stage
    # computes at the same time. On a CPU the calls run one after another, clock or not.
    for clock in range(num_micro_batches + num_stages - 1):
        for s in range(num_stages):
            i = clock - s
            if 0 <= i < num_micro_batches:
                activations[i] = stages[s](activations[i].to(devices[s]))
    loss = sum(F.mse_loss(output, y.to(output.device)) * (y.shape[0] / batch_size)
               for output, y in zip(activations, micro_targets, strict=True))
    # One backward through every micro-batch's graph: autograd runs each device's part on that
    # device's own thread, so the backward overlaps across devices too.
    loss.backward()
    return loss.detach()


def bubble_fraction(num_stages: int, num_micro_batches: int) -> float:
    """The idle share of each device in a GPipe step: (p - 1) / (m + p - 1)."""
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError(f"need at least one stage and one micro-batch, got num_stages="
                         f"{num_stages}, num_micro_batches={num_micro_batches}")
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def ideal_speedup(num_stages: int, num_micro_batches: int) -> float:
    """Step time at m = 1 over step time at m, if stages overlap and nothing else costs."""
    return num_stages * num_micro_batches / (num_micro_batches + num_stages - 1)


def sync_all(devices) -> None:
    """gpt.run's sync for each device: a clock stops only when every one has finished."""
    for device in devices:
        run.sync(device)


def gradients(stages) -> list[torch.Tensor]:
    return [p.grad.detach().cpu().clone() for stage in stages for p in stage.parameters()]


def sweep(devices, width: int, depth: int, batch_size: int, micro_batch_counts, steps: int,
          lr: float = 0.01, log=print) -> list[dict]:
    """Time a training step for every m in ``micro_batch_counts``; one result row per m."""
    stages = build_stages(width, depth, devices)
    params = [p for stage in stages for p in stage.parameters()]
    start_state = copy.deepcopy([stage.state_dict() for stage in stages])
    g = torch.Generator().manual_seed(1)
    inputs = torch.randn(batch_size, width, generator=g)
    targets = torch.tanh(inputs @ (torch.randn(width, width, generator=g) / width**0.5))
    inputs, targets = inputs.to(devices[0]), targets.to(devices[-1])
    p = len(stages)

    first = f"m={micro_batch_counts[0]}"
    header = (f"{'m':>4} {'micro-batch':>11} {'step ms':>9} {'vs ' + first:>7} {'bubble':>7} "
              f"{'ideal vs ' + first:>12} {'grad diff vs ' + first:>17}")
    log(header)
    rows: list[dict] = []
    reference_grads = None
    for m in micro_batch_counts:
        # Gradients first, all from the same weights, to compare every m with the first.
        for stage, state in zip(stages, start_state, strict=True):
            stage.load_state_dict(state)
            stage.zero_grad(set_to_none=True)
        gpipe_step(stages, devices, inputs, targets, m)
        grads = gradients(stages)
        if reference_grads is None:
            reference_grads = grads
        grad_diff = max(float((a - b).abs().max()) for a, b in zip(grads, reference_grads,
                                                                    strict=True))
        # Then the timed training steps (which change the weights: that does not change speed).
        optimizer = torch.optim.SGD(params, lr=lr)
        seconds = []
        for step in range(WARMUP_STEPS + steps):
            sync_all(devices)
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            gpipe_step(stages, devices, inputs, targets, m)
            optimizer.step()
            sync_all(devices)  # the clock stops when every device has finished
            if step >= WARMUP_STEPS:
                seconds.append(time.perf_counter() - start)
        step_ms = 1000 * statistics.median(seconds)
        first_ms = rows[0]["step_ms"] if rows else step_ms
        row = {"micro_batches": m, "micro_batch_size": -(-batch_size // m), "step_ms": step_ms,
               "speedup": first_ms / step_ms, "bubble": bubble_fraction(p, m),
               "ideal_speedup": ideal_speedup(p, m) / ideal_speedup(p, micro_batch_counts[0]),
               "grad_max_diff": grad_diff}
        rows.append(row)
        log(f"{m:>4} {row['micro_batch_size']:>11} {step_ms:>9.1f} {row['speedup']:>6.2f}x "
            f"{row['bubble']:>7.1%} {row['ideal_speedup']:>11.2f}x {grad_diff:>17.1e}")
    return rows


def explain(devices, log=print) -> None:
    """What to expect from this pair of devices."""
    if len(set(devices)) == 1:
        log(f"Every stage runs on {devices[0]}. One device executes the stages one after another,")
        log("so micro-batches cannot overlap: there is no idle device to fill, and more")
        log("micro-batches only add overhead (smaller matrix products, more Python calls).")
        log("On GPUs, CUDA kernels are queued asynchronously on each device, so stage 0 can run")
        log("micro-batch i + 1 while stage 1 runs micro-batch i: that overlap is what the")
        log("'ideal' column counts on.")
    elif all(d.type == "cuda" for d in devices):
        log("Every stage has its own GPU, and CUDA kernels are queued asynchronously on each")
        log("device: while stage 1 computes micro-batch i, stage 0 already computes i + 1. More")
        log("micro-batches shrink the bubble (the 'ideal' column), until they get too small to")
        log("keep a GPU busy and per-micro-batch overhead wins.")
    else:
        log("One stage runs on the CPU, in the same Python thread that queues the GPU's work,")
        log("and copying a result from the GPU to the CPU waits for the GPU: expect little")
        log("overlap. Two GPUs are needed to see pipelining pay off.")


def check_matplotlib() -> str | None:
    """None when matplotlib can be imported, else the reason it cannot."""
    try:
        import matplotlib  # noqa: F401  (imported only when --plot asks for it)
    except ImportError as err:
        return str(err)
    return None


def plot(rows: list[dict], devices, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # draw to a file; no display needed
    import matplotlib.pyplot as plt

    ms = [row["micro_batches"] for row in rows]
    measured = [row["step_ms"] for row in rows]
    ideal = [rows[0]["step_ms"] / row["ideal_speedup"] for row in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ms, measured, "o-", label="measured")
    ax.plot(ms, ideal, "--", label="ideal: only the bubble, stages overlap")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches per step (m)")
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"GPipe on {' -> '.join(str(d) for d in devices)}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_devices(text: str) -> list[torch.device]:
    try:
        devices = [torch.device(p.strip()) for p in text.split(",")]
    except RuntimeError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if len(devices) < 2:
        raise argparse.ArgumentTypeError(f"expected at least two devices, got {text!r}")
    return devices


def parse_counts(text: str) -> list[int]:
    try:
        counts = [int(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4,8, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("micro-batch counts must be at least 1")
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=parse_devices, default=None,
                        help="one device per stage, e.g. cuda:0,cuda:1 (default: the best pair)")
    parser.add_argument("--width", type=int, default=None,
                        help="features per layer (default 4096 on GPUs only, else 512)")
    parser.add_argument("--blocks", type=int, default=8, help="Linear layers (default 8)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="samples per step (default 8192 on GPUs only, else 512)")
    parser.add_argument("--micro-batches", type=parse_counts, default=[1, 2, 4, 8, 16, 32],
                        help="the values of m to try (default 1,2,4,8,16,32)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per m (default 5)")
    parser.add_argument("--plot", type=Path, help="draw step time against m to this image file")
    parser.add_argument("--result", type=Path, help="write the rows as JSON to this path")
    args = parser.parse_args(argv)

    if args.plot is not None and (why := check_matplotlib()):
        print(f"pipeline_sweep.py: error: --plot needs matplotlib ({why}); install it with "
              "`pip install matplotlib`, or run without --plot", file=sys.stderr)
        return 2
    devices = args.devices or pick_device_pair()
    on_gpus = all(d.type == "cuda" for d in devices)
    width = args.width or (4096 if on_gpus else 512)
    batch_size = args.batch_size or (8192 if on_gpus else 512)
    if min(width, args.blocks, batch_size, args.steps) < 1:
        parser.error("--width, --blocks, --batch-size and --steps must be at least 1")
    if args.blocks < len(devices):
        parser.error(f"--blocks {args.blocks} is too small for {len(devices)} stages")
    counts = [m for m in args.micro_batches if m <= batch_size]
    if not counts:
        parser.error(f"every --micro-batches value exceeds the batch size {batch_size}")

    print(f"torch {torch.__version__}; {len(devices)} stages on "
          f"{' -> '.join(str(d) for d in devices)}; {args.blocks} layers of width {width}, "
          f"batch {batch_size}; median of {args.steps} steps per m")
    rows = sweep(devices, width, args.blocks, batch_size, counts, args.steps)
    explain(devices)

    if args.plot is not None:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(rows, devices, args.plot)
        print(f"plot written to {args.plot}")
    if args.result is not None:
        result = {"devices": [str(d) for d in devices], "width": width, "blocks": args.blocks,
                  "batch_size": batch_size, "steps": args.steps, "rows": rows,
                  "torch": torch.__version__}
        args.result.parent.mkdir(parents=True, exist_ok=True)
        args.result.write_text(json.dumps(result, indent=2) + "\n")
        print(f"result written to {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
