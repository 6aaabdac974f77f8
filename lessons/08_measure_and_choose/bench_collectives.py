"""What a collective costs: time, algorithm bandwidth and bus bandwidth, over message sizes.

    torchrun --standalone --nproc-per-node=2 lessons/08_measure_and_choose/bench_collectives.py
    torchrun ... bench_collectives.py --csv collectives.csv --plot collectives.svg

In the style of the standard NCCL benchmarks (nccl-tests): each collective runs on every size
from ``--min-bytes`` to ``--max-bytes`` (times 4 each row), a few untimed warm-up calls first,
then ``--repeats`` loops of ``--steps`` timed calls back to back; a row's time is the median
loop's mean, on the slowest rank. The bus
bandwidth multiplies the algorithm bandwidth (payload / time) by what a rank of a ring sends per
byte of payload, 2 (W - 1) / W for an all-reduce, so that it can be compared with the link's
own speed. At the end, a straight line fitted to the all-reduce times gives the link's latency
alpha and time per byte beta (t = 2 (W - 1) alpha + 2 (W - 1) / W * n * beta), and the model's
prediction is printed beside every measured row.

gloo on CPUs, nccl when every rank has a GPU (``--backend`` to choose). Other scripts of this
lesson import ``time_collective`` and ``fit_alpha_beta`` from here.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

# Before any group exists: DDP imports torch.distributed.nn on first use, and its functions then
# keep the group as a default argument, so that destroy_process_group cannot free it and the
# process may abort at exit ("terminate called without an active exception"). The scripts that
# import this one (ddp_costs.py, scaling.py, moe_costs.py) get it too.
import torch.distributed.nn  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
from gpt import run  # noqa: E402 - the plumbing every script shares: run.setup joins the group

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (the old names now warn);
# torch 2.11 and 2.12 have only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
RING_FACTOR = {"all_reduce": lambda w: 2 * (w - 1) / w, "all_gather": lambda w: (w - 1) / w,
               "reduce_scatter": lambda w: (w - 1) / w, "broadcast": lambda w: 1.0}
COLUMNS = ("op", "backend", "world_size", "bytes", "seconds", "algbw_GBps", "busbw_GBps",
           "predicted_seconds")


def _call(op: str, payload: torch.Tensor, piece: torch.Tensor) -> None:
    if op == "all_reduce":
        dist.all_reduce(payload)
    elif op == "all_gather":
        all_gather_single(payload, piece)
    elif op == "reduce_scatter":
        reduce_scatter_single(piece, payload)
    elif op == "all_to_all":  # not a row of this benchmark: lesson 11 times its exchanges here
        dist.all_to_all_single(piece, payload)  # piece: as large as payload for this op
    else:
        dist.broadcast(payload, src=0)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously to Python); a CPU has none."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_collective(op: str, num_bytes: int, device: torch.device, iters: int = 5,
                    warmup: int = 2, dtype: torch.dtype = torch.float32,
                    repeats: int = 5) -> float:
    """Seconds one ``op`` of a ``num_bytes`` payload takes: the slowest rank's mean of
    ``iters`` calls back to back, and of ``repeats`` such loops the median (a loop that a
    busy machine interrupted is one of five, not a fifth of every row)."""
    world = dist.get_world_size()
    numel = max(world, num_bytes // torch.tensor([], dtype=dtype).element_size())
    numel -= numel % world  # a payload that splits evenly into the ranks' pieces
    payload = torch.ones(numel, dtype=dtype, device=device)
    piece = torch.ones(numel if op == "all_to_all" else numel // world, dtype=dtype,
                       device=device)
    for _ in range(warmup):
        _call(op, payload, piece)
    loops = []
    for _ in range(repeats):
        synchronize(device)
        dist.barrier()
        began = time.perf_counter()
        for _ in range(iters):
            _call(op, payload, piece)
        synchronize(device)
        loops.append((time.perf_counter() - began) / iters)
    slowest = torch.tensor(loops, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.median())


def fit_alpha_beta(sizes: list[int], seconds: list[float], world_size: int) -> tuple[float, float]:
    """The ring model's (alpha, beta) from all-reduce times: a line t = a + b n fitted to the
    relative errors (least squares weighted by 1 / t**2, so that the large times do not drown
    the latency the small ones measure), then alpha = a / (2 (W - 1)) and
    beta = b / (2 (W - 1) / W)."""
    if len(sizes) != len(seconds):
        raise ValueError(f"{len(sizes)} sizes but {len(seconds)} times: one time per size")
    if len(set(sizes)) < 2:
        raise ValueError(f"a line needs at least two distinct sizes; got {sorted(set(sizes))}")
    if world_size < 2:
        raise ValueError(f"an all-reduce on {world_size} rank moves nothing: need world_size >= 2")
    if min(seconds) <= 0:
        raise ValueError(f"times must be positive; got {min(seconds)}")
    n = torch.tensor(sizes, dtype=torch.float64)
    t = torch.tensor(seconds, dtype=torch.float64)
    design = torch.stack([1 / t, n / t], dim=1)
    a, b = torch.linalg.lstsq(design, torch.ones_like(t)[:, None]).solution[:, 0]
    steps = 2 * (world_size - 1)
    return float(a) / steps, float(b) / (steps / world_size)


def predict_allreduce_seconds(num_bytes: int, world_size: int, alpha: float,
                              beta: float) -> float:
    """The ring all-reduce's time for ``num_bytes`` on ``world_size`` ranks, from (alpha, beta)."""
    if world_size < 1 or num_bytes < 0:
        raise ValueError(f"need world_size >= 1 and num_bytes >= 0; got {world_size}, "
                         f"{num_bytes}")
    steps = 2 * (world_size - 1)
    return steps * alpha + steps * num_bytes / world_size * beta


def plot_collectives(rows: list[dict], path: Path, title: str) -> None:
    """Bus bandwidth per op, and the all-reduce times with the fitted line, as one SVG."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for op in OPS:
        mine = [r for r in rows if r["op"] == op]
        if mine:
            left.plot([r["bytes"] for r in mine], [r["busbw_GBps"] for r in mine], "o-",
                      label=op)
    left.set(xscale="log", xlabel="payload (bytes)", ylabel="bus bandwidth (GB/s)")
    left.legend()
    reduce_rows = [r for r in rows if r["op"] == "all_reduce"]
    sizes = [r["bytes"] for r in reduce_rows]
    right.plot(sizes, [r["seconds"] * 1e3 for r in reduce_rows], "o", label="measured")
    right.plot(sizes, [r["predicted_seconds"] * 1e3 for r in reduce_rows], "-",
               label="2(W-1)α + 2(W-1)/W·n·β")
    right.set(xscale="log", yscale="log", xlabel="payload (bytes)", ylabel="all-reduce (ms)")
    right.legend()
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    figure.savefig(path, format="svg", metadata={"Date": None})  # no date: the file is stable
    plt.close(figure)


def sizes_between(low: int, high: int) -> list[int]:
    sizes = [low]
    while sizes[-1] * 4 <= high:
        sizes.append(sizes[-1] * 4)
    return sizes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated: " + ", ".join(OPS))
    parser.add_argument("--min-bytes", type=int, default=1024)
    parser.add_argument("--max-bytes", type=int, default=64 * 1024 * 1024)
    parser.add_argument("--steps", type=int, default=5, help="calls timed back to back")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed loops of --steps calls per row: the row is their median")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--csv", type=Path, help="write every row here")
    parser.add_argument("--plot", type=Path, help="draw an SVG here (needs matplotlib)")
    parser.add_argument("--result", type=Path, help="write rows and the fit as JSON here")
    args = parser.parse_args(argv)
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = sorted(set(ops) - set(OPS))
    if (unknown or not 0 < args.min_bytes <= args.max_bytes or args.steps < 1
            or args.repeats < 1):
        print(f"error: ops must be among {', '.join(OPS)} (got {unknown or ops}), and "
              f"0 < --min-bytes <= --max-bytes, --steps >= 1, --repeats >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    try:
        rank, world, device = run.setup(args.backend, __file__)
    except ValueError as err:  # a partial launcher environment, nccl without a GPU per rank
        return run.refuse(__file__, err)
    if world < 2:
        if rank == 0:
            print("error: a collective on one rank moves nothing; start 2 or more with "
                  "torchrun --nproc-per-node=2", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    backend = dist.get_backend()
    rows = []
    if rank == 0:
        print(f"{backend}, {world} ranks, {device.type}; time = the median of {args.repeats} "
              f"loops of the slowest rank's mean of {args.steps}")
        print(f"{'op':>15} {'bytes':>10} {'time (us)':>11} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    for op in ops:
        for size in sizes_between(args.min_bytes, args.max_bytes):
            seconds = time_collective(op, size, device, args.steps, args.warmup,
                                      repeats=args.repeats)
            algbw = size / seconds / 1e9
            rows.append({"op": op, "backend": backend, "world_size": world, "bytes": size,
                         "seconds": seconds, "algbw_GBps": algbw,
                         "busbw_GBps": algbw * RING_FACTOR[op](world)})
            if rank == 0:
                print(f"{op:>15} {size:>10} {seconds * 1e6:>11.1f} {algbw:>11.3f} "
                      f"{rows[-1]['busbw_GBps']:>11.3f}")
    fit = None
    reduce_rows = [r for r in rows if r["op"] == "all_reduce"]
    if len(reduce_rows) >= 2:
        alpha, beta = fit_alpha_beta([r["bytes"] for r in reduce_rows],
                                     [r["seconds"] for r in reduce_rows], world)
        fit = {"alpha_s": alpha, "beta_s_per_byte": beta, "world_size": world}
        for r in reduce_rows:
            r["predicted_seconds"] = predict_allreduce_seconds(r["bytes"], world, alpha, beta)
    if rank == 0:
        if fit and fit["beta_s_per_byte"] <= 0:
            print("all-reduce fit: the times do not grow with the size (noise, or sizes too "
                  "small to see the bandwidth): rerun with a larger --max-bytes")
        elif fit:
            print(f"all-reduce fit: alpha {fit['alpha_s'] * 1e6:.1f} us per step, "
                  f"1/beta {1 / fit['beta_s_per_byte'] / 1e9:.3f} GB/s")
            for r in reduce_rows:
                error = (r["predicted_seconds"] - r["seconds"]) / r["seconds"]
                print(f"  {r['bytes']:>10} B: measured {r['seconds'] * 1e6:>10.1f} us, "
                      f"predicted {r['predicted_seconds'] * 1e6:>10.1f} us ({error:+.0%})")
        if args.csv:
            with args.csv.open("w", newline="") as handle:
                writer = csv.DictWriter(handle, COLUMNS)
                writer.writeheader()
                writer.writerows({c: r.get(c, "") for c in COLUMNS} for r in rows)
            print(f"wrote {args.csv}")
        if args.plot and fit:
            try:
                title = f"{backend}, {world} ranks, {device.type}, torch {torch.__version__}"
                plot_collectives(rows, args.plot, title)
                print(f"wrote {args.plot}")
            except ImportError:
                print("no plot: matplotlib is not installed (pip install matplotlib)")
        if args.result:
            args.result.write_text(json.dumps({"rows": rows, "fit": fit, "backend": backend}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
