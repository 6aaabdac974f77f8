"""Make one device fast first: time one training step under a ladder of settings.

    python lessons/00_single_gpu/fast_one_device.py                # sizes chosen for the device
    python lessons/00_single_gpu/fast_one_device.py --width 1024 --blocks 2 --steps 5

The model is a stack of MLP blocks, Linear(w, 4w) - GELU - Linear(4w, w), trained with AdamW
(fused on CUDA). Each rung of the ladder is a fresh model timed over a few steps after warm-up:

    fp32 -> TF32 matmuls (CUDA only) -> bf16 autocast -> + torch.compile -> a larger batch

TFLOP/s counts 6 x weights x batch per step (2 for the forward matmuls, 4 for the backward).
On CUDA each rung is also shown as a percentage of a bf16 matmul peak measured here and now.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
from gpt.run import sync  # noqa: E402  wait for the GPU before reading a clock

# On a GPU: the sizes of the H200 numbers the README quotes; on a 2-core CPU: about a minute.
CUDA_SIZES = {"width": 4096, "blocks": 4, "batch_size": 8192, "steps": 10}
CPU_SIZES = {"width": 256, "blocks": 2, "batch_size": 512, "steps": 20}


def build_mlp(width: int, blocks: int) -> nn.Sequential:
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)]
    return nn.Sequential(*layers)


def count_weights(model: nn.Module) -> int:
    """Matrix weights only: biases add no matmul work."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def seconds_per_call(fn, device: torch.device, warmup: int, steps: int) -> float:
    for _ in range(warmup):  # first calls pay for allocation, kernel choice and compilation
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return (time.perf_counter() - start) / steps


def bf16_matmul_peak(device: torch.device, n: int = 8192, reps: int = 50) -> float:
    """The bf16 matmul TFLOP/s this GPU reaches on large square matrices."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    seconds = seconds_per_call(lambda: torch.mm(a, b, out=out), device, warmup=5, steps=reps)
    return 2 * n**3 / seconds / 1e12


def time_training_step(device, width, blocks, batch, *, bf16, compile, warmup, steps) -> float:
    """Seconds per training step (forward, loss, backward, AdamW) for a fresh model."""
    torch.manual_seed(0)
    with device:  # create the weights directly on the device: no slow CPU init, no copy
        model = build_mlp(width, blocks)
        inputs = torch.randn(batch, width)
        targets = torch.randn(batch, width)
    if device.type == "cuda":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    forward = torch.compile(model) if compile else model

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = nn.functional.mse_loss(forward(inputs).float(), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return seconds_per_call(step, device, warmup, steps)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Time one training step under fp32, TF32, "
                                     "bf16 autocast, torch.compile and a larger batch.")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--width", type=int, help="model width w (default: by device)")
    parser.add_argument("--blocks", type=int, help="number of MLP blocks (default: by device)")
    parser.add_argument("--batch-size", type=int, help="batch size (default: by device)")
    parser.add_argument("--steps", type=int, help="timed steps per rung (default: by device)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per rung")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rungs")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("fast_one_device.py: error: --device cuda, but no CUDA GPU is usable here")
        return 2
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")
    sizes = dict(CUDA_SIZES if cuda else CPU_SIZES)
    for key in sizes:
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    if min(sizes.values()) < 1 or args.warmup < 0:
        print("fast_one_device.py: error: sizes and --steps must be positive, --warmup >= 0")
        return 2
    width, blocks, steps = sizes["width"], sizes["blocks"], sizes["steps"]
    batch = sizes["batch_size"]

    weights = count_weights(build_mlp(width, blocks).to("meta"))  # meta: shapes, no memory
    where = torch.cuda.get_device_name(device) if cuda else f"{torch.get_num_threads()} threads"
    print(f"device {device} ({where}), torch {torch.__version__}")
    print(f"model: {blocks} x [Linear({width}, {4 * width}) - GELU - Linear({4 * width}, "
          f"{width})] = {weights:,} weights; AdamW ({'fused' if cuda else 'foreach'})")
    print(f"each rung: a fresh model, {args.warmup} warm-up steps, then {steps} timed steps")
    peak = None
    if cuda:
        peak = bf16_matmul_peak(device)
        print(f"bf16 matmul peak measured here: {peak:.0f} TFLOP/s")

    previous_precision = torch.get_float32_matmul_precision()
    rungs = [("fp32", batch, dict(bf16=False, compile=False, tf32=False))]
    if cuda:
        rungs.append(("tf32", batch, dict(bf16=False, compile=False, tf32=True)))
    else:
        print("tf32: does not apply on CPU (TF32 is a tensor-core format of NVIDIA GPUs)")
    rungs.append(("bf16 autocast", batch, dict(bf16=True, compile=False, tf32=cuda)))
    if args.no_compile:
        print("bf16 autocast + compile: skipped (--no-compile)")
    else:
        rungs.append(("bf16 autocast + compile", batch, dict(bf16=True, compile=True, tf32=cuda)))
    rungs.append((None, 2 * batch, None))  # the larger batch, with the best setting that ran

    print(f"{'setting':<34} {'batch':>6} {'ms/step':>9} {'samples/s':>11} {'TFLOP/s':>8}"
          f"{'  % of bf16 peak' if cuda else ''}")
    best = None
    try:
        for name, rung_batch, setting in rungs:
            if name is None:
                name, setting = f"{best[0]}, batch x2", best[1]
            torch.set_float32_matmul_precision("high" if setting["tf32"] else "highest")
            try:
                seconds = time_training_step(
                    device, width, blocks, rung_batch, bf16=setting["bf16"],
                    compile=setting["compile"], warmup=args.warmup, steps=steps)
            except Exception as err:  # compilation needs a working toolchain; say what broke
                if not setting["compile"]:
                    raise
                reason = (str(err).strip().splitlines() or [""])[0][:160]
                print(f"{name}: skipped, torch.compile failed: {type(err).__name__}: {reason}")
                continue
            finally:
                if cuda:
                    torch.cuda.empty_cache()  # give the next rung the whole memory
            best = (name, setting)
            tflops = 6 * weights * rung_batch / seconds / 1e12
            share = f"{100 * tflops / peak:16.1f}" if peak else ""
            print(f"{name:<34} {rung_batch:>6} {1000 * seconds:>9.1f} "
                  f"{rung_batch / seconds:>11,.0f} {tflops:>#8.3g}{share}", flush=True)
    finally:
        torch.set_float32_matmul_precision(previous_precision)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
