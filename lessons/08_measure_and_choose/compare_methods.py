"""The methods side by side: the running example trained with each, at the same global batch.

    python lessons/08_measure_and_choose/compare_methods.py --csv methods.csv --plot methods.svg

For one process, DDP, FSDP2 (as it is, with every block checkpointed, and never resharded after
the forward), tensor parallel and pipeline parallel (1F1B, interleaved 1F1B with 2 chunks per
rank, and zero bubble), and nn.DataParallel where there are 2 GPUs, this starts
``torchrun --nproc-per-node=2`` on this same file once. Its ranks train the same model with each
method in turn, for ``--steps`` timed steps of ``--batch-size`` sequences in all (split over the
ranks as the method splits them; a one-process method runs on rank 0 while rank 1 waits), and
report for each method:

- samples per second (the global batch over the median step time of the slowest rank);
- each rank's training state (weights, gradients, AdamW's two moments) measured from what the
  rank holds, beside the prediction of lesson 05's rule (16 bytes per parameter the rank
  keeps), and on GPUs the peak memory torch's allocator reports;
- the step's peak: the most bytes the tensors one step creates hold at once beyond the state
  it keeps (activations, gathered parameters, buffers; ``harness.memory.AllocationPeak``), on
  every device;
- the payload bytes of the collectives and point-to-point sends one rank starts per step,
  counted as torch dispatches them, beside the prediction of lessons 03, 05, 06 and 07;
- the exposed communication: the step time minus the same rank's step in a world whose
  collectives complete at once (torch's fake process group), which is the computation alone.

It writes a CSV and an SVG plot (with matplotlib). Everything is measured in one run, on the
machine it prints; ratios between methods carry over better than the numbers.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.nn  # noqa: E402, F401 - before any group exists (see bench_collectives.setup)
import torch.nn.functional as F  # noqa: E402
from gpt import GPT, GPTConfig, GPTStage  # noqa: E402
from gpt.run import local_part, positive_int  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from harness.memory import AllocationPeak  # noqa: E402

# Each trains the running example on 2 ranks, or on one process (1). The levers of lessons 05 and
# 07 are rows of their own: FSDP2 with every block checkpointed or never resharded after the
# forward, and the pipeline with interleaved 1F1B (2 chunks per rank) or zero bubble.
METHODS = {"one process": 1, "ddp": 2, "fsdp": 2, "fsdp+ac": 2, "fsdp no reshard": 2, "tp": 2,
           "pp": 2, "pp interleaved": 2, "pp zero bubble": 2, "dataparallel": 1}
CHUNKS = {"pp": 1, "pp interleaved": 2, "pp zero bubble": 1}  # pipeline stages per rank
COLUMNS = ("method", "ranks", "device", "samples_per_s", "step_ms", "compute_ms",
           "exposed_comm_ms", "state_bytes", "predicted_state_bytes", "step_peak_bytes",
           "peak_bytes", "comm_bytes", "predicted_comm_bytes")
MICRO_BATCHES = 4  # the pipelines', a multiple of their 2 ranks (interleaved 1F1B's rounds)


# The ops that move data, by the start of their names in c10d (allreduce_, _allgather_base_,
# reduce_scatter_tensor_coalesced_, send, ...) and in the functional collectives (all_reduce,
# all_gather_into_tensor, reduce_scatter_tensor, ...); not receives, waits or barriers.
SENDING = ("allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter", "broadcast",
           "alltoall", "all_to_all", "send")


class CommBytes(TorchDispatchMode):
    """The payload bytes of every collective and send this rank starts, as torch dispatches
    them (c10d's ops, and the functional collectives DTensor uses)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(getattr(func, "_overloadpacket", func)).split(".")[-1].strip("_")
        if func.namespace in ("c10d", "_c10d_functional") and name.startswith(SENDING):
            # c10d's ops take (outputs, inputs, ...): an all-gather's output is the gathered
            # whole, a reduce-scatter's input is the whole. The functional ones take the input
            # first, and an all-gather's input is one rank's piece of the whole.
            first, times = (args[0] if args else None), 1
            if name.startswith("reduce_scatter") and func.namespace == "c10d":
                first = args[1]
            elif name.startswith("all_gather") and func.namespace == "_c10d_functional":
                times = int(args[1])  # group_size
            tensors = first if isinstance(first, (list, tuple)) else [first]
            for t in tensors:
                for leaf in (t if isinstance(t, (list, tuple)) else [t]):
                    if isinstance(leaf, torch.Tensor):
                        self.bytes += leaf.numel() * leaf.element_size() * times
        return func(*args, **(kwargs or {}))


def state_tensors(module: torch.nn.Module, optimizer) -> list[torch.Tensor]:
    """This rank's parameters, their gradients and the optimizer's state tensors (AdamW's step
    counts among them), a DTensor by its local piece: what a rank keeps from step to step."""
    tensors = [local_part(p) for p in module.parameters()]
    tensors += [local_part(p.grad) for p in module.parameters() if p.grad is not None]
    tensors += [local_part(v) for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor)]
    return tensors


def state_bytes(module: torch.nn.Module, optimizer) -> int:
    """Bytes of the distinct storages behind :func:`state_tensors`, the step counts left out."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in state_tensors(module, optimizer) if t.dim() > 0}
    return sum(storages.values())


def no_communication(state, bucket):
    """A DDP hook for the fake world: the bucket as it is, at once (a fake all-reduce's future
    carries no tensor, which DDP's own hook needs)."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def build(method: str, config: GPTConfig, device: torch.device, batch_size: int,
          fake: bool = False):
    """(step function, module whose state counts, optimizer, bytes predicted per step)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = GPT(config, seed=0).to(device)
    params = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, config.vocab_size, (batch_size, config.block_size + 1),
                           generator=torch.Generator().manual_seed(0)).to(device)
    # contiguous: torch 2.11's pipelining refuses an input whose strides differ from its example's
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    activation = batch_size * config.block_size * config.n_embd * 4  # (B, T, C) fp32
    if method == "ddp" or method.startswith("fsdp"):  # each rank its share of the batch
        share = batch_size // world
        inputs, targets = (t[rank * share:(rank + 1) * share] for t in (inputs, targets))
    # Lesson 03: DDP all-reduces every gradient. Lesson 05: FSDP2 all-gathers the parameters for
    # the forward, again for the backward unless it kept them, and reduce-scatters the
    # gradients. Lesson 06: 4 all-reduces of (B, T, C) per block. Lesson 07: rank 0's stage
    # sends the batch's activations forward; with 2 chunks per rank its second chunk also sends
    # its input's gradient back, and its activations on: 3 times as much.
    predicted = {"one process": 0, "dataparallel": 0, "ddp": 4 * params,
                 "fsdp": 3 * 4 * params, "fsdp+ac": 3 * 4 * params,
                 "fsdp no reshard": 2 * 4 * params, "tp": 4 * config.n_layer * activation,
                 "pp": activation, "pp interleaved": 3 * activation,
                 "pp zero bubble": activation}[method]
    if method == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        if fake:
            model.register_comm_hook(None, no_communication)
    elif method == "dataparallel":
        model = torch.nn.DataParallel(model, device_ids=[0, 1])
    elif method.startswith("fsdp"):
        from torch.distributed.fsdp import fully_shard

        if method == "fsdp+ac":  # lesson 05: each block keeps only its input for the backward
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                checkpoint_wrapper,
            )

            for index, block in enumerate(model.blocks):
                model.blocks[index] = checkpoint_wrapper(block)
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=method != "fsdp no reshard")
        fully_shard(model)
    elif method == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh(device.type, (world,))
        plan = {"attn": PrepareModuleInput(input_layouts=(Replicate(),),
                                           desired_input_layouts=(Replicate(),),
                                           use_local_output=False),
                **{f"attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")},
                "attn.out_proj": RowwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()}
        for block in model.blocks:
            parallelize_module(block, mesh, plan)
    if method in CHUNKS:
        return pipeline(method, model, inputs, targets, device, predicted, fake)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        model(inputs, targets)[1].mean().backward()  # DataParallel gathers one loss per GPU
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    return step, model, optimizer, predicted


def pipeline(method: str, model: GPT, inputs: torch.Tensor, targets: torch.Tensor,
             device: torch.device, predicted: int, fake: bool):
    """``build`` for the pipelines of lesson 07: rank r's chunk c is stage c * W + r of
    W * chunks, each an equal run of blocks (stage 0 with the embeddings, the last with the
    head)."""
    from torch.distributed import pipelining

    rank, world = dist.get_rank(), dist.get_world_size()
    count = world * CHUNKS[method]
    per = len(model.blocks) // count
    indices = [c * world + rank for c in range(CHUNKS[method])]
    chunks = torch.nn.ModuleList(GPTStage(model, k * per, (k + 1) * per) for k in indices)
    optimizer = torch.optim.AdamW(chunks.parameters(), lr=1e-3)
    last = count - 1

    def loss_fn(logits, y):
        return F.cross_entropy(logits.mT, y)

    if fake:  # each chunk's own work, micro-batch by micro-batch, with nothing to wait for
        pieces = list(zip(inputs.chunk(MICRO_BATCHES), targets.chunk(MICRO_BATCHES),
                          strict=True))
        shape = (len(inputs) // MICRO_BATCHES, inputs.shape[1], model.config.n_embd)

        def step() -> None:
            for x, y in pieces:
                for k, chunk in zip(indices, chunks, strict=True):
                    given = x if k == 0 else torch.randn(shape, device=device, requires_grad=True)
                    out = chunk(given)
                    if k == last:
                        (loss_fn(out, y) / MICRO_BATCHES).backward()
                    else:
                        out.backward(torch.ones_like(out))
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

        return step, chunks, optimizer, predicted
    stages = [pipelining.PipelineStage(chunk, k, count, device)
              for k, chunk in zip(indices, chunks, strict=True)]
    if method == "pp":
        schedule = pipelining.Schedule1F1B(stages[0], MICRO_BATCHES, loss_fn=loss_fn)
    else:
        cls = {"pp interleaved": pipelining.ScheduleInterleaved1F1B,
               "pp zero bubble": pipelining.ScheduleInterleavedZeroBubble}[method]
        schedule = cls(stages, MICRO_BATCHES, loss_fn=loss_fn)

    def step() -> None:
        stage_inputs = (inputs,) if 0 in indices else ()  # the first stage takes the batch
        stage_targets = {"target": targets} if last in indices else {}  # the last, the targets
        schedule.step(*stage_inputs, **stage_targets)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    return step, chunks, optimizer, predicted


def timed_steps(step, steps: int, device: torch.device, warmup: int = 2) -> float:
    """The median step time of this rank, in seconds, after ``warmup`` untimed steps."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for i in range(steps + warmup):
        sync()
        began = time.perf_counter()
        step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def slowest(value: float, device: torch.device) -> float:
    """The largest value over the ranks."""
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def worker(args) -> None:
    """Every method on the ranks torchrun started: measured, then again in a fake world. A
    one-rank method (one process, nn.DataParallel) runs on rank 0 while the others wait."""
    import gc

    # A GPU per rank, or the CPU for every rank (two NCCL ranks cannot share one GPU).
    use_cuda = args.device != "cpu" and torch.cuda.device_count() >= int(
        os.environ.get("LOCAL_WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(args.threads)
    # Long enough for the others to wait while rank 0 trains alone.
    dist.init_process_group("nccl" if use_cuda else "gloo",
                            timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    config = GPTConfig(vocab_size=65, block_size=args.context, n_layer=args.blocks, n_head=4,
                       n_embd=args.width)
    methods = args.worker.split(",")
    rows = {}
    for method in methods:
        alone = METHODS[method] == 1
        if alone and rank != 0:
            dist.barrier()  # wait while rank 0 trains alone
            continue
        if use_cuda:
            torch.cuda.reset_peak_memory_stats(device)
        step, module, optimizer, predicted_comm = build(method, config, device, args.batch_size)
        seconds = timed_steps(step, args.steps, device, args.warmup)
        seconds = seconds if alone else slowest(seconds, device)
        kept = state_tensors(module, optimizer)
        with AllocationPeak(ignore=kept) as peak, CommBytes() as counter:  # beyond the state
            step()
        own_params = sum(local_part(p).numel() for p in module.parameters())
        rows[method] = {
            "method": method, "rank": rank, "ranks": 1 if alone else world, "device": str(device),
            "samples_per_s": args.batch_size / seconds, "step_ms": seconds * 1e3,
            "state_bytes": state_bytes(module, optimizer),
            "predicted_state_bytes": 16 * own_params, "step_peak_bytes": peak.bytes,
            "peak_bytes": torch.cuda.max_memory_allocated(device) if use_cuda else None,
            "comm_bytes": counter.bytes, "predicted_comm_bytes": predicted_comm}
        del step, module, optimizer, kept, peak  # the next method's peak starts from nothing
        gc.collect()  # free now what only reference cycles hold: it may hold the group
        if alone:
            dist.barrier()
    dist.barrier()
    dist.destroy_process_group()

    # The same rank's work where communication costs nothing: torch's fake process group
    # completes every collective at once, without any other rank.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    for method, row in rows.items():
        if row["ranks"] == 1:  # nothing to communicate: its step is its computation
            row["compute_ms"], row["exposed_comm_ms"] = row["step_ms"], 0.0
            continue
        step, *_ = build(method, config, device, args.batch_size, fake=True)
        compute = timed_steps(step, args.steps, device, args.warmup)
        row["compute_ms"] = compute * 1e3
        row["exposed_comm_ms"] = max(0.0, row["step_ms"] / 1e3 - compute) * 1e3
        del step
        gc.collect()
    dist.destroy_process_group()
    # Every rank's rows to rank 0 through a file each: the real group is gone.
    Path(f"{args.out}.{rank}").write_text(json.dumps(list(rows.values())))
    if rank == 0:
        deadline = time.monotonic() + 120
        while not all(Path(f"{args.out}.{r}").exists() for r in range(world)):
            if time.monotonic() > deadline:
                raise TimeoutError("a rank never wrote its rows")
            time.sleep(0.05)
        gathered = [row for r in range(world)
                    for row in json.loads(Path(f"{args.out}.{r}").read_text())]
        order = {m: i for i, m in enumerate(methods)}
        gathered.sort(key=lambda row: (order[row["method"]], row["rank"]))
        Path(args.out).write_text(json.dumps(gathered))


def plot_methods(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    firsts = [r for r in rows if r["rank"] == 0]
    names = [r["method"] for r in firsts]
    # Two by two, so that each panel keeps a readable size at a page's width.
    plt.rcParams.update({"font.size": 11})
    figure, grid = plt.subplots(2, 2, figsize=(10, 7.5))
    axes = grid.reshape(-1)
    axes[0].bar(names, [r["samples_per_s"] for r in firsts])
    axes[0].set(ylabel="samples / s", title="throughput")
    axes[1].bar(names, [r["compute_ms"] for r in firsts], label="computation")
    axes[1].bar(names, [r["exposed_comm_ms"] for r in firsts],
                bottom=[r["compute_ms"] for r in firsts], label="exposed communication")
    axes[1].set(ylabel="ms per step", title="where a step's time goes")
    axes[1].legend(fontsize=10)
    width = 0.4
    xs = range(len(names))
    axes[2].bar([x - width / 2 for x in xs], [r["state_bytes"] / 2**20 for r in firsts], width,
                label="state, measured")
    axes[2].bar([x - width / 2 for x in xs], [r["step_peak_bytes"] / 2**20 for r in firsts],
                width, bottom=[r["state_bytes"] / 2**20 for r in firsts],
                label="a step's peak above it")
    axes[2].bar([x + width / 2 for x in xs], [r["predicted_state_bytes"] / 2**20 for r in firsts],
                width, label="state, 16 B / parameter")
    axes[2].set(ylabel="MiB on rank 0", title="memory per rank")
    axes[2].set_xticks(list(xs), names)
    axes[2].legend(fontsize=10)
    axes[3].bar([x - width / 2 for x in xs], [r["comm_bytes"] / 2**20 for r in firsts], width,
                label="counted")
    axes[3].bar([x + width / 2 for x in xs], [r["predicted_comm_bytes"] / 2**20 for r in firsts],
                width, label="the lessons' formulas")
    axes[3].set(ylabel="MiB sent by rank 0", title="payload per step")
    axes[3].set_xticks(list(xs), names)
    axes[3].legend(fontsize=10)
    for axis in axes:
        axis.tick_params(axis="x", labelrotation=35, labelsize=9)
        for label in axis.get_xticklabels():
            label.set_horizontalalignment("right")
    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    figure.savefig(path, format="svg", metadata={"Date": None})
    plt.close(figure)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="all", help="comma-separated, of " + ", ".join(
        METHODS))
    parser.add_argument("--device", default="auto", choices=["auto", "cpu"])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step, in all")
    parser.add_argument("--steps", type=positive_int, default=6)
    parser.add_argument("--warmup", type=positive_int, default=2,
                        help="untimed steps first (at least 1: DDP rebuilds its buckets in its "
                             "second step, which the step whose bytes are counted must follow)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--csv", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--result", type=Path, help="write every row as JSON here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # the methods, comma-separated
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if "RANK" in os.environ:
        print("error: run this with plain python: it starts torchrun itself",
              file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count() if args.device == "auto" else 0
    wanted = list(METHODS) if args.methods == "all" else [m.strip() for m in
                                                           args.methods.split(",")]
    unknown = [m for m in wanted if m not in METHODS]
    stages = max([2 * CHUNKS.get(m, 1) for m in wanted if m not in unknown], default=2)
    if unknown or args.batch_size % (2 * MICRO_BATCHES) or args.blocks % stages:
        print(f"error: methods must be among {', '.join(METHODS)} (got {unknown}); "
              f"--batch-size must divide by {2 * MICRO_BATCHES} and --blocks by {stages} "
              f"(the pipelines' stages on 2 ranks)", file=sys.stderr)
        return 2
    if "dataparallel" in wanted and gpus < 2:
        wanted.remove("dataparallel")
        print("nn.DataParallel skipped: it needs 2 GPUs (without them it is a pass-through)")
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rows.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={max(METHODS[m] for m in wanted)}", __file__,
                   "--worker", ",".join(wanted), "--out", str(out), "--device", args.device,
                   "--width", str(args.width), "--blocks", str(args.blocks),
                   "--context", str(args.context), "--batch-size", str(args.batch_size),
                   "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--threads", str(args.threads)]
        run = subprocess.run(command, capture_output=True, text=True, timeout=900,
                             env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        if run.returncode != 0 or not out.exists():
            print(f"the methods' run failed:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}",
                  file=sys.stderr)
            return 1
        rows = json.loads(out.read_text())
    print(f"torch {torch.__version__}; {args.width} wide, {args.blocks} blocks, context "
          f"{args.context}, global batch {args.batch_size}; rank 0 of each method")
    print(f"{'method':>15} {'ranks':>5} {'samples/s':>9} {'step':>8} {'compute':>8} "
          f"{'exposed':>8} {'state MiB':>9} {'predicted':>9} {'step peak':>9} {'comm MiB':>8} "
          f"{'predicted':>9}")
    for r in rows:
        if r["rank"] == 0:
            print(f"{r['method']:>15} {r['ranks']:>5} {r['samples_per_s']:>9.1f} "
                  f"{r['step_ms']:>6.1f}ms {r['compute_ms']:>6.1f}ms "
                  f"{r['exposed_comm_ms']:>6.1f}ms {r['state_bytes'] / 2**20:>9.2f} "
                  f"{r['predicted_state_bytes'] / 2**20:>9.2f} "
                  f"{r['step_peak_bytes'] / 2**20:>9.2f} {r['comm_bytes'] / 2**20:>8.2f} "
                  f"{r['predicted_comm_bytes'] / 2**20:>9.2f}")
    if args.csv:
        with args.csv.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, ("rank", *COLUMNS))
            writer.writeheader()
            writer.writerows({c: r.get(c) for c in ("rank", *COLUMNS)} for r in rows)
        print(f"wrote {args.csv}")
    if args.plot:
        try:
            plot_methods(rows, args.plot, f"{rows[0]['device']}, torch {torch.__version__}, "
                         f"global batch {args.batch_size}, {args.width} wide x {args.blocks}")
            print(f"wrote {args.plot}")
        except ImportError:
            print("no plot: matplotlib is not installed (pip install matplotlib)")
    if args.result:
        args.result.write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
