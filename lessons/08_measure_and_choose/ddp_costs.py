"""What DDP's gradient communication costs in a step: predicted, then measured.

    torchrun --standalone --nproc-per-node=2 lessons/08_measure_and_choose/ddp_costs.py
    torchrun ... ddp_costs.py --trace ddp_step.json      # also a torch.profiler trace

1. Fit the link's alpha and beta from all-reduces of this machine (``bench_collectives.py``).
2. For each DDP setting (the default buckets, small buckets, one big bucket,
   ``gradient_as_bucket_view``, a bf16 compression hook): read the buckets DDP built, predict
   their all-reduce time from the fit (one ring all-reduce per bucket) plus two copies of the
   gradients (into the buckets and back; none when they are views), and measure the
   *exposed* communication: the step time with gradient synchronisation minus the step time
   without it (``no_sync``), the steps of the two kinds interleaved (the median difference of
   neighbouring steps).
3. With ``--trace``: profile one step and say when the all-reduces ran against the backward.

The prediction is the time the all-reduces take; the measurement is the part of it the step
waits for. Where they differ, the difference is overlap (the all-reduces ran while the backward
still computed) or interference (they competed with it for the same cores).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this lesson's bench_collectives
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench_collectives import (  # noqa: E402
    fit_alpha_beta,
    predict_allreduce_seconds,
    synchronize,
    time_collective,
)
from gpt import GPT, GPTConfig, run  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

MiB = 1024 * 1024


def bf16_allreduce(state, bucket):
    """torch's bf16 compression hook under another name: DDP refuses a hook named
    ``bf16_compress_hook`` on torch builds without CUDA and NCCL, though gloo reduces bf16."""
    return default_hooks.bf16_compress_hook(state, bucket)


# name -> (DDP keywords, communication hook, bytes per gradient element on the wire)
SETTINGS = {
    "default buckets (25 MiB)": ({}, None, 4),
    "bucket_cap_mb=1": ({"bucket_cap_mb": 1}, None, 4),
    "one bucket (bucket_cap_mb=1000)": ({"bucket_cap_mb": 1000}, None, 4),
    "gradient_as_bucket_view": ({"gradient_as_bucket_view": True}, None, 4),
    "bf16 compression hook": ({}, bf16_allreduce, 2),
}


def bucket_bytes(model: DDP) -> list[int]:
    """The bytes of each bucket DDP built (after its first step it rebuilds them in the order
    the gradients became ready)."""
    return [b.buffer().numel() * b.buffer().element_size()
            for b in model.reducer._get_zeros_like_grad_buckets()]


def gradient_storages(model: DDP) -> int:
    """How many distinct storages hold the gradients: one per parameter, or, with
    ``gradient_as_bucket_view``, one per bucket (each gradient a view into its bucket)."""
    return len({p.grad.untyped_storage().data_ptr() for p in model.parameters()
                if p.grad is not None})


def copy_seconds_per_byte(num_bytes: int, device: torch.device, repeats: int = 5) -> float:
    """Time per byte of copying a tensor of ``num_bytes`` into another (memory bandwidth)."""
    source = torch.ones(num_bytes // 4, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    synchronize(device)
    began = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source)
    synchronize(device)
    return (time.perf_counter() - began) / repeats / num_bytes


def measure(model: DDP, optimizer, batches, steps: int, device) -> dict:
    """Median step times with and without gradient synchronisation, the two kinds interleaved,
    and the median of their differences: the exposed communication."""

    def step(inputs, targets):
        _, loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        # Not None: gradients that are views into the buckets stay views, with no copy at all.
        optimizer.zero_grad(set_to_none=False)

    times = {"sync": [], "no_sync": []}
    for i in range(2 * steps):
        inputs, targets = batches[i % len(batches)]
        kind = "sync" if i % 2 == 0 else "no_sync"
        dist.barrier()
        synchronize(device)
        began = time.perf_counter()
        if kind == "sync":
            step(inputs, targets)
        else:
            with model.no_sync():
                step(inputs, targets)
        synchronize(device)
        times[kind].append(time.perf_counter() - began)
    # Every step's slowest rank (a step is as slow as its slowest rank); the exposed time is the
    # median difference of neighbouring steps, which cancels what drifts during the run.
    slowest = torch.tensor([times["sync"], times["no_sync"]], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    with_sync, without = slowest.tolist()
    return {"step_s": statistics.median(with_sync), "step_no_sync_s": statistics.median(without),
            "exposed_s": statistics.median(a - b for a, b in zip(with_sync, without, strict=True))}


def trace_one_step(model: DDP, optimizer, batch, path: Path, device) -> dict:
    """A torch.profiler trace of one synchronised step, and when its all-reduces ran."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    inputs, targets = batch
    with profile(activities=activities) as prof:
        _, loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    if dist.get_rank() == 0:
        prof.export_chrome_trace(str(path))
    events = prof.events()
    comms = [e for e in events if "allreduce" in e.name.replace("_", "").lower()]
    backward = [e for e in events if e.name.startswith("autograd::engine::evaluate_function")]
    if not comms or not backward:
        return {"all_reduces": len(comms)}
    backward_end = max(e.time_range.end for e in backward)
    first = min(e.time_range.start for e in comms)
    return {"all_reduces": len(comms),
            "first_all_reduce_before_backward_end_ms": (backward_end - first) / 1e3}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--width", type=int, default=256, help="n_embd of the running example")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each kind")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--settings", default="all",
                        help="comma-separated indices into the settings (0-based), or all")
    parser.add_argument("--trace", type=Path, help="write a chrome trace of one step here")
    parser.add_argument("--result", type=Path, help="write the numbers as JSON here")
    args = parser.parse_args(argv)
    names = list(SETTINGS)
    chosen = names if args.settings == "all" else [
        names[int(i)] for i in args.settings.split(",")]
    torch.set_num_threads(args.threads)
    try:
        rank, world, device = run.setup(args.backend, __file__)
    except ValueError as err:  # a partial launcher environment, nccl without a GPU per rank
        return run.refuse(__file__, err)
    if world < 2:
        if rank == 0:
            print("error: DDP on one rank sends nothing; start 2 or more with "
                  "torchrun --nproc-per-node=2", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    config = GPTConfig(vocab_size=65, block_size=args.context, n_layer=args.blocks,
                       n_head=4, n_embd=args.width)
    base = GPT(config, seed=0).to(device)
    model_bytes = sum(p.numel() * p.element_size() for p in base.parameters())

    # 1. The link, from all-reduces of the sizes DDP's buckets will have.
    sizes = [s for s in (256 * 1024, MiB, 4 * MiB, 16 * MiB, 64 * MiB) if s <= 2 * model_bytes]
    sizes = sizes if len(sizes) >= 2 else [64 * 1024, 256 * 1024]
    times = [time_collective("all_reduce", s, device, iters=8) for s in sizes]
    alpha, beta = fit_alpha_beta(sizes, times, world)
    # DDP copies each gradient into its bucket (dividing by the world size on the way) and,
    # after the all-reduce, back: two passes over the gradients, unless they are the buckets.
    copy_beta = copy_seconds_per_byte(model_bytes, device)
    if rank == 0:
        print(f"{dist.get_backend()}, {world} ranks, {device.type}; the running example: "
              f"{base.num_parameters() / 1e6:.2f} M parameters, {model_bytes / MiB:.1f} MiB "
              f"of fp32 gradients per step")
        print(f"link fit: alpha {alpha * 1e6:.0f} us, 1/beta {1 / beta / 1e9:.2f} GB/s; "
              f"memory copies {1 / copy_beta / 1e9:.2f} GB/s")
        print(f"{'setting':>32} {'buckets (MiB)':>24} {'predicted':>10} {'exposed':>9} "
              f"{'step':>8} {'no_sync':>8}  gradient storages")

    generator = torch.Generator().manual_seed(rank)
    batches = [tuple(t.to(device) for t in torch.randint(
        0, config.vocab_size, (2, args.batch_size, args.context), generator=generator))
        for _ in range(4)]
    results = {}
    for name in chosen:
        keywords, hook, wire_bytes = SETTINGS[name]
        model = DDP(copy.deepcopy(base), device_ids=[device.index] if device.type == "cuda"
                    else None, **keywords)
        if hook is not None:
            model.register_comm_hook(None, hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        for inputs, targets in batches[:2]:  # warm-up; DDP rebuilds its buckets after step 1
            model(inputs, targets)[1].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        buckets = bucket_bytes(model)
        predicted = sum(predict_allreduce_seconds(b * wire_bytes // 4, world, alpha, beta)
                        for b in buckets)
        copies = 0 if keywords.get("gradient_as_bucket_view") else 2
        predicted += copies * sum(buckets) * copy_beta
        measured = measure(model, optimizer, batches, args.steps, device)
        results[name] = {"buckets_bytes": buckets, "predicted_s": predicted,
                         "gradient_storages": gradient_storages(model), **measured}
        if rank == 0:
            shown = ", ".join(f"{b / MiB:.1f}" for b in buckets)
            print(f"{name:>32} {shown:>24} {predicted * 1e3:>8.1f}ms "
                  f"{measured['exposed_s'] * 1e3:>7.1f}ms {measured['step_s'] * 1e3:>6.1f}ms "
                  f"{measured['step_no_sync_s'] * 1e3:>6.1f}ms  "
                  f"{results[name]['gradient_storages']}")
        if args.trace and name == chosen[0]:
            traced = trace_one_step(model, optimizer, batches[0], args.trace, device)
            results[name]["trace"] = traced
            if rank == 0:
                print(f"  trace of one step in {args.trace}: {traced}")
        # A DDP left in reference cycles holds the process group: free it now, not at exit
        # (where torch 2.13 was seen to hang with three of them left).
        del model, optimizer
        gc.collect()
    if rank == 0:
        first = results[chosen[0]]
        ratio = first["predicted_s"] / first["exposed_s"] if first["exposed_s"] > 0 else None
        print(f"{chosen[0]}: predicted / exposed = "
              f"{f'{ratio:.2f}' if ratio is not None else 'n/a (nothing exposed)'}")
        if args.result:
            args.result.write_text(json.dumps({
                "backend": dist.get_backend(), "world_size": world, "alpha_s": alpha,
                "beta_s_per_byte": beta, "model_bytes": model_bytes, "settings": results}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
