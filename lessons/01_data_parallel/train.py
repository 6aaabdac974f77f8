"""Train the same model with and without nn.DataParallel, and time both.

    python lessons/01_data_parallel/train.py                     # every GPU, or [0, 0] on one
    python lessons/01_data_parallel/train.py --device-ids 0,1 --hidden 4096 --batch-size 8192
    python lessons/01_data_parallel/train.py --steps 5 --result runs/dp.json

Both runs start from the same weights and see the same batches, so they should end with the
same parameters (up to float rounding), and the script says how far apart they are. The batch
size is the *global* batch: DataParallel splits it across the devices. On a machine without a
CUDA GPU, DataParallel is a pass-through, so only the one-device run is timed.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

IN_FEATURES, N_CLASSES = 32, 4
WARMUP_STEPS = 3  # not timed: CUDA start-up, kernel selection, the allocator's first requests


def make_batches(steps: int, batch_size: int, seed: int = 1234):
    """``steps`` batches of (features, labels), labelled by a fixed random "teacher" network."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(IN_FEATURES, N_CLASSES, generator=g)
    batches = []
    for _ in range(steps):
        x = torch.randn(batch_size, IN_FEATURES, generator=g)
        batches.append((x, (x @ teacher).argmax(dim=1)))
    return batches


def build_model(hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(IN_FEATURES, hidden), nn.GELU(),
        nn.Linear(hidden, hidden), nn.GELU(),
        nn.Linear(hidden, N_CLASSES),
    )


def sync(device: torch.device) -> None:
    """CUDA kernels run asynchronously: wait for them before reading the clock."""
    if device.type == "cuda":
        for index in range(torch.cuda.device_count()):  # DataParallel's replicas use them all
            torch.cuda.synchronize(index)


def train(step_model: nn.Module, params: nn.Module, batches, device: torch.device, lr: float):
    """Plain SGD over ``batches``. ``step_model`` is what is called (the model itself, or its
    DataParallel wrapper); ``params`` owns the parameters. Returns (samples/s, last loss)."""
    optimizer = torch.optim.SGD(params.parameters(), lr=lr, momentum=0.9)
    batches = [(x.to(device), y.to(device)) for x, y in batches]  # the data is not what we time
    timed_samples, start = 0, None
    for step, (x, y) in enumerate(batches):
        if step == WARMUP_STEPS:
            sync(device)
            start = time.perf_counter()
        # DataParallel: x is scattered from here, and the gathered output lands on output_device.
        out = step_model(x)
        loss = F.cross_entropy(out, y.to(out.device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if start is not None:
            timed_samples += x.shape[0]
    sync(device)
    seconds = time.perf_counter() - start
    return timed_samples / seconds, loss.item()


def max_difference(a: nn.Module, b: nn.Module) -> float:
    return max((p.detach().cpu() - q.detach().cpu()).abs().max().item()
               for p, q in zip(a.parameters(), b.parameters(), strict=True))


def parse_device_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected GPU indices like 0,1 or 0,0; got {text}") from None
    return ids


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help=f"timed steps (+{WARMUP_STEPS})")
    parser.add_argument("--batch-size", type=int, default=1024, help="the global batch")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--device-ids", type=parse_device_ids, default=None,
                        help="GPUs for DataParallel, e.g. 0,1 (default: every GPU; 0,0 on one)")
    parser.add_argument("--result", type=Path, help="write the numbers as JSON to this path")
    args = parser.parse_args(argv)
    if min(args.steps, args.batch_size, args.hidden) < 1:
        parser.error("--steps, --batch-size and --hidden must be at least 1")

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = torch.device("cuda:0" if gpus else "cpu")
    torch.manual_seed(0)
    model = build_model(args.hidden)  # built once on the CPU: both runs start from these weights
    batches = make_batches(args.steps + WARMUP_STEPS, args.batch_size)
    print(f"torch {torch.__version__}, {gpus} CUDA GPU(s); {args.steps} timed steps of a global "
          f"batch of {args.batch_size}, hidden {args.hidden}")
    result = {"torch": torch.__version__, "gpus": gpus, "steps": args.steps,
              "batch_size": args.batch_size, "hidden": args.hidden}

    single = copy.deepcopy(model).to(device)
    rate, loss = train(single, single, batches, device, args.lr)
    label = f"one device ({device}):"
    print(f"{label:<32} {rate:>12,.0f} samples/s   last loss {loss:.4f}")
    result["one_device"] = {"device": str(device), "samples_per_s": rate, "loss": loss}

    if gpus == 0:
        print("no CUDA GPU: nn.DataParallel is a pass-through here (it calls the model directly, "
              "on the CPU), so there is nothing to compare; run this on a GPU machine.")
    else:
        device_ids = args.device_ids or (list(range(gpus)) if gpus > 1 else [0, 0])
        first = torch.device("cuda", device_ids[0])
        dp_model = copy.deepcopy(model).to(first)  # DataParallel wants it on device_ids[0]
        wrapped = nn.DataParallel(dp_model, device_ids=device_ids)
        for index in sorted(set(device_ids)):
            torch.cuda.reset_peak_memory_stats(index)
        dp_rate, dp_loss = train(wrapped, dp_model, batches, first, args.lr)
        peaks = {f"cuda:{i}": torch.cuda.max_memory_allocated(i) / 2**20
                 for i in sorted(set(device_ids))}
        label = f"DataParallel {device_ids}:"
        print(f"{label:<32} {dp_rate:>12,.0f} samples/s   last loss {dp_loss:.4f}   "
              f"({dp_rate / rate:.2f}x one device)")
        print("peak memory during the DataParallel run: "
              + ", ".join(f"{name} {mib:,.0f} MiB" for name, mib in peaks.items()))
        difference = max_difference(single, dp_model)
        print(f"largest parameter difference between the two runs: {difference:.2e}")
        result["data_parallel"] = {"device_ids": device_ids, "samples_per_s": dp_rate,
                                   "loss": dp_loss, "peak_mib": peaks,
                                   "max_parameter_difference": difference}

    if args.result is not None:
        args.result.parent.mkdir(parents=True, exist_ok=True)
        args.result.write_text(json.dumps(result, indent=2) + "\n")
        print(f"result written to {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
