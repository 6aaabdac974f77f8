"""Balancing a pipeline by time: time each layer, cut on the times, and watch the step follow
the slowest stage.

    torchrun --standalone --nproc-per-node=2 lessons/07_pipeline_parallel/balance_stages.py

The running example, 12 blocks 64 wide, with a vocabulary of 4,096 tokens (its embedding and its
head each hold as many parameters as 5 blocks), so that parameters and compute disagree. Every rank
times each layer's forward and backward on one micro-batch (layer i is block i, the embeddings
counted in the first layer, the final norm, the head and the loss in the last), and the ranks
average their times, so that all of them choose the same cuts. Then the same GPipe pipeline, one
stage per rank, runs on these cuts of the blocks:

- equal blocks per stage (``train_pp.py``'s);
- balanced by parameters (task 7_3's rule: what each stage must hold);
- balanced by time (task 7_8's rule, on the times just measured);
- on 2 ranks, every other cut as well, to see the whole curve.

For each it prints the stages' times from the layers' times, the step GPipe would take with them,
T_0 + ... + T_(p-1) + (m - 1) * max T_s (each T_s per micro-batch), and the step the pipeline
took (the slowest rank's, median over ``--steps``; the cuts take turns, a step each). Every cut
starts from the same model, so its first step's losses and gradients are the unsplit model's:
the result file keeps them, and the test compares them.

With ``--backend nccl`` (one GPU per rank) the same runs on GPUs. One thread per rank on the CPU:
more ranks than cores would time each other's work.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gpt import GPT, GPTConfig, GPTStage, run  # noqa: E402
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe  # noqa: E402


def fastest_cut(costs: list[float], num_stages: int) -> list[int]:
    """How many consecutive layers each stage gets so that the costliest stage costs least,
    ties to the fewest layers in the first stage, then the second...: task 7_3's and task 7_8's
    rule, without trying every cut (C(79, 7) for 80 layers in 8 stages). A stage's cost is the
    sum of its layers'. The costliest stage of the best cut costs the sum of some run of layers:
    find the smallest of those sums for which ``num_stages`` stages of at most that cost cover
    every layer (filling each stage greedily needs the fewest). Then give each stage the fewest
    layers that leave the rest coverable by the stages left."""
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"{n} layers cannot be cut into {num_stages} stages of at least one "
                         f"layer each")

    def stages_needed(start: int, limit: float) -> float:  # for layers start..n-1, greedily
        needed, begin = 0, start
        for i in range(start, n):
            if costs[i] > limit:
                return float("inf")
            # A stage's cost is summed as the candidates are (Python 3.12's sum() of floats is
            # compensated: adding one cost at a time can differ in the last bit).
            if i == start or sum(costs[begin:i + 1]) > limit:  # a new stage, from this layer
                needed, begin = needed + 1, i
        return needed

    sums = sorted({sum(costs[a:b]) for a in range(n) for b in range(a + 1, n + 1)})
    low, high = 0, len(sums) - 1  # the largest, every layer's, is one stage: always enough
    while low < high:  # the smallest sum that is enough, by bisection: more is never worse
        middle = (low + high) // 2
        if stages_needed(0, sums[middle]) <= num_stages:
            high = middle
        else:
            low = middle + 1
    limit = sums[low]
    counts, start = [], 0
    for left in range(num_stages - 1, 0, -1):  # the stages after this one
        take = 1  # (it stops at the latest where the rest has a layer per stage left)
        while stages_needed(start + take, limit) > left:
            take += 1  # the rest needs more stages than are left: this one takes another layer
        counts.append(take)
        start += take
    return counts + [n - start]


def layer_parameters(model: GPT) -> list[int]:
    """Each layer's parameters: the one-block stage that ``layer_seconds`` times, block i with
    the embeddings in the first and the final norm and the head in the last."""
    return [sum(p.numel() for p in GPTStage(model, i, i + 1).parameters())
            for i in range(model.config.n_layer)]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def make_batch(vocab_size: int, batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and targets, the same on every rank: timing needs no text."""
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randint(0, vocab_size, (batch, context), generator=generator)
                 for _ in range(2))


def layer_seconds(model: GPT, ids, targets, repeats: int, device) -> list[float]:
    """The median forward and backward time of each layer alone, on a micro-batch ``ids``."""
    config, seconds = model.config, []
    generator = torch.Generator().manual_seed(1)
    activations = torch.randn(*ids.shape, config.n_embd, generator=generator).to(device)
    for i in range(config.n_layer):
        layer = GPTStage(model, i, i + 1)
        times = []
        for repeat in range(repeats + 2):  # 2 untimed: the first calls allocate and warm caches
            # what the pipeline's stage receives: ids on the first, activations (whose gradient
            # it sends back) on the others
            x = ids if i == 0 else activations.detach().requires_grad_()
            with run.timed(device) as timer:
                out = layer(x)
                if layer.last:
                    loss_fn(out, targets).backward()
                else:
                    out.backward(torch.ones_like(out))
            if repeat >= 2:
                times.append(timer.seconds)
        layer.zero_grad(set_to_none=True)
        seconds.append(statistics.median(times))
    return seconds


def gpipe_step(stage_seconds: list[float], micro_batches: int) -> float:
    """GPipe's step with these per-micro-batch stage times (each stage's backward the same
    multiple of its forward): the first micro-batch crosses every stage, the rest follow at
    the slowest's pace."""
    return sum(stage_seconds) + (micro_batches - 1) * max(stage_seconds)


class Pipeline:
    """GPipe over one cut of the model (a copy of its own): this rank's stage, the slowest
    rank's time of each timed step, and what the first step computed (the micro-batches'
    losses and, for each stage, the sum of its gradients' squares)."""

    def __init__(self, config: GPTConfig, counts: list[int], micro_batches: int, rank: int,
                 device):
        start = sum(counts[:rank])
        self.stage = GPTStage(GPT(config, seed=0).to(device), start, start + counts[rank])
        self.schedule = ScheduleGPipe(PipelineStage(self.stage, rank, len(counts), device),
                                      micro_batches, loss_fn=loss_fn)
        self.first, self.last, self.device = rank == 0, rank == len(counts) - 1, device
        self.steps: list[float] = []
        self.first_step: dict | None = None

    def step(self, inputs, targets, timed: bool) -> None:
        losses: list[torch.Tensor] = []  # the last stage's, one per micro-batch
        dist.barrier()  # every stage starts the step together
        began = time.perf_counter()
        self.schedule.step(*((inputs,) if self.first else ()),
                           **({"target": targets, "losses": losses} if self.last else {}))
        run.sync(self.device)
        seconds = torch.tensor(time.perf_counter() - began, device=self.device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the step ends when its last rank does
        if timed:  # not the first steps, which exchange the shapes and warm the caches
            self.steps.append(seconds.item())
        if self.first_step is None:
            missing = [name for name, p in self.stage.named_parameters() if p.grad is None]
            if missing:  # a failed rank: torchrun stops the others
                raise RuntimeError(f"after a step, no gradient for {missing}")
            squares = [None] * dist.get_world_size()  # each stage's own
            dist.all_gather_object(squares, sum(p.grad.float().square().sum().item()
                                                for p in self.stage.parameters()))
            shared = [[loss.item() for loss in losses]]
            dist.broadcast_object_list(shared, src=dist.get_world_size() - 1)
            self.first_step = {"losses": shared[0], "grad_square_sums": squares}
        self.stage.zero_grad(set_to_none=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=run.positive_int, default=12)
    parser.add_argument("--width", type=run.positive_int, default=64)
    parser.add_argument("--vocab-size", type=run.positive_int, default=4096)
    parser.add_argument("--context", type=run.positive_int, default=64)
    parser.add_argument("--micro-batch-size", type=run.positive_int, default=8,
                        help="sequences per micro-batch")
    parser.add_argument("--micro-batches", type=run.positive_int, default=8)
    parser.add_argument("--steps", type=run.positive_int, default=3, help="timed steps per cut")
    parser.add_argument("--repeats", type=run.positive_int, default=10,
                        help="timed forward and backward passes per layer")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--result", type=Path, help="write the numbers as JSON to this path")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        stages = int(os.environ.get("WORLD_SIZE", 1))  # one per rank
        if stages > args.blocks:
            raise ValueError(f"{stages} stages cannot share {args.blocks} blocks (at least one "
                             f"each); pass --blocks {stages} or more")
        if args.width % 4:
            raise ValueError(f"--width {args.width} must split into 4 heads")
        rank, world, device = run.setup(args.backend, __file__)
    except ValueError as err:  # a partial launcher environment, nccl without a GPU per rank
        return run.refuse(__file__, err)
    torch.set_num_threads(1)  # a core per rank
    config = GPTConfig(vocab_size=args.vocab_size, block_size=args.context, n_layer=args.blocks,
                       n_head=4, n_embd=args.width)
    model = GPT(config, seed=0).to(device)
    inputs, targets = (t.to(device) for t in make_batch(
        args.vocab_size, args.micro_batch_size * args.micro_batches, args.context))

    # Every rank times every layer at once, as they will run; the mean is what all cut on.
    seconds = torch.tensor(layer_seconds(model, inputs[:args.micro_batch_size],
                                         targets[:args.micro_batch_size], args.repeats, device),
                           device=device)
    dist.all_reduce(seconds)
    seconds = (seconds / world).tolist()
    parameters = layer_parameters(model)
    named = {"equal blocks": tuple(args.blocks // world + (s < args.blocks % world)
                                   for s in range(world)),
             "by parameters": tuple(fastest_cut(parameters, world)),
             "by time": tuple(fastest_cut(seconds, world))}
    cuts = sorted({*named.values(), *(((k, args.blocks - k) for k in range(1, args.blocks))
                                      if world == 2 else ())})
    pipelines = [Pipeline(config, counts, args.micro_batches, rank, device) for counts in cuts]
    # The cuts take turns, a step each, so that the machine's other work slows all of them alike.
    for step in range(args.steps + 2):
        for pipeline in pipelines:
            pipeline.step(inputs, targets, timed=step >= 2)
    rows = []
    for counts, pipeline in zip(cuts, pipelines, strict=True):
        bounds = [sum(counts[:s]) for s in range(world + 1)]
        stage_s = [sum(seconds[a:b]) for a, b in itertools.pairwise(bounds)]
        rows.append({"blocks": list(counts), "names": [n for n, c in named.items() if c == counts],
                     "stage_s": stage_s,
                     "predicted_step_s": gpipe_step(stage_s, args.micro_batches),
                     "step_s": statistics.median(pipeline.steps), **pipeline.first_step})

    if rank == 0:
        print(f"{args.blocks} blocks x {args.width} wide, vocabulary {args.vocab_size}, context "
              f"{args.context}; GPipe on {world} ranks ({device.type}), {args.micro_batches} "
              f"micro-batches of {args.micro_batch_size} sequences")
        print("layer  parameters  forward + backward of a micro-batch")
        for i, (count, s) in enumerate(zip(parameters, seconds, strict=True)):
            parts = (["embeddings"] if i == 0 else []) + [f"block {i}"] + (
                ["norm, head, loss"] if i == args.blocks - 1 else [])
            note = ", ".join(parts)
            print(f"{i:5d}  {count:10,d}  {s * 1e3:7.2f} ms  {note}")
        print("blocks per stage  stages' times (ms)  predicted step  measured step")
        for row in rows:
            times = " ".join(f"{s * 1e3:.1f}" for s in row["stage_s"])
            print(f"{' '.join(map(str, row['blocks'])):16s}  {times:18s}  "
                  f"{row['predicted_step_s'] * 1e3:11.1f} ms  {row['step_s'] * 1e3:10.1f} ms  "
                  + ", ".join(row["names"]))
        if args.result:
            args.result.write_text(json.dumps({
                "world_size": world, "micro_batches": args.micro_batches,
                "layer_parameters": parameters, "layer_s": seconds, "rows": rows}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
