"""Lesson 03's train_ddp.py as a pipeline: each process runs a stage of the model's blocks.

    torchrun --standalone --nproc-per-node=2 lessons/07_pipeline_parallel/train_pp.py  # 2 stages
    python lessons/07_pipeline_parallel/train_pp.py                        # 1 stage, no launcher

Every stage reads the same batches; torch's 1F1B schedule cuts each into --micro-batches and
sends activations forward, gradients back. --batch-size is the whole batch, read by every stage.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
# gpt: the running example (model, data); gpt.run: the plumbing every step shares
from gpt import GPT, SIZES, GPTConfig, GPTStage, run  # noqa: E402


def make_loaders(train_set, val_set, batch_size: int, seed: int, device: torch.device):
    # Pinned (page-locked) host memory is what lets a host-to-GPU copy run asynchronously.
    pin = device.type == "cuda"
    # Every stage reads every index in one order, in whole batches: the schedule cuts each one.
    order = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=seed)
    train_loader = DataLoader(train_set, batch_size, sampler=order, pin_memory=pin, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=batch_size, shuffle=False, pin_memory=pin)
    return train_loader, val_loader


def train_one_epoch(schedule, loader, optimizer, device, amp=None) -> float:
    """One pass over ``loader``; returns the mean training loss per sample."""
    first, last = dist.get_rank() == 0, dist.get_rank() == dist.get_world_size() - 1
    # Summed where the loss is (a tensor from the first step on): a .item() per step would
    # make the CPU wait for the GPU every step.
    loss_sum, seen = torch.zeros((), device=device), 0  # a tensor on every stage
    for inputs, targets in loader:
        # non_blocking: with pinned memory the copy overlaps with work already queued on the GPU.
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        losses = []  # the last stage's, one per micro-batch
        optimizer.zero_grad(set_to_none=True)
        # The first stage feeds the batch in, the last takes the targets and keeps the losses;
        # the stages between receive their inputs from the previous one.
        stage_inputs = (inputs,) if first else ()
        stage_targets = {"target": targets, "losses": losses} if last else {}
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            schedule.step(*stage_inputs, **stage_targets)
        optimizer.step()  # this stage's parameters only
        if last:
            loss_sum += torch.stack(losses).mean().detach() * len(targets)
        seen += targets.shape[0]
    totals = torch.stack([loss_sum, torch.tensor(float(seen), device=device)])
    dist.broadcast(totals, src=dist.get_world_size() - 1)  # the last stage's numbers, to all
    return (totals[0] / totals[1]).item()


def busy_clock(module, device) -> dict[str, float]:
    """Seconds ``module`` spends computing, every forward and backward, kept in ``["busy"]``."""
    clock = {"busy": 0.0, "started": 0.0}

    def tick(*args) -> None:  # 2 arguments for the pre-hooks, 3 forward's hook, 1 the grads'
        run.sync(device)  # on a GPU, wait for its work first
        now = time.perf_counter()
        if len(args) != 2:  # a forward or a backward has just ended
            clock["busy"] += now - clock["started"]
        clock["started"] = now

    for register in (module.register_forward_pre_hook, module.register_forward_hook,
                     module.register_full_backward_pre_hook):
        register(tick)
    torch.autograd.graph.register_multi_grad_hook(list(module.parameters()), tick)  # ends backward
    return clock


def fit(device: torch.device, size: str = "tiny", epochs: int = 3, batch_size: int = 16,
        lr: float = 3e-3, seed: int = 0, train_windows: int | None = None, bf16: bool = False,
        micro_batches: int = 4,
        sample_length: int = 60, log=print):
    """Train from scratch on ``device``; returns (model, result dict)."""
    dataset, train_set, val_set = run.windows(size, train_windows)
    train_loader, val_loader = make_loaders(train_set, val_set, batch_size, seed, device)

    # Built on the CPU from its own seeded generator, then moved: the same start on any device.
    model = GPT(GPTConfig.named(size, vocab_size=dataset.vocab_size), seed=seed).to(device)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    per = len(model.blocks) // world_size  # equal runs of blocks: a stage per process
    stages = [GPTStage(model, s * per, (s + 1) * per) for s in range(world_size)]
    # Created after the move, so the optimizer's state is allocated on the device as well.
    optimizer = torch.optim.AdamW(stages[rank].parameters(), lr=lr)  # this stage's only
    clock = busy_clock(stages[rank], device)
    schedule = Schedule1F1B(
        PipelineStage(stages[rank], rank, world_size, device), micro_batches,
        loss_fn=lambda logits, y: F.cross_entropy(logits.float().flatten(0, 1), y.flatten()))
    amp = torch.bfloat16 if bf16 else None

    where = f"{world_size} stage(s) of {per} block(s), batch {batch_size} in {micro_batches} pieces"
    result = run.begin_result(log, device, where, model, dataset, train_set, val_set, sample_length,
                              size=size, seed=seed, epochs=epochs, batch_size=batch_size,
                              lr=lr, bf16=bf16, micro_batches=micro_batches)
    for epoch in range(1, epochs + 1):
        with run.timed(device) as timer:  # the device's queued work included
            train_loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on all ranks
            train_loss = train_one_epoch(schedule, train_loader, optimizer, device, amp)
        for owner, stage in enumerate(stages):  # each stage's trained weights to every rank,
            for p in stage.parameters():        # to evaluate and sample the whole model
                dist.broadcast(p.data, src=owner)
        val_loss, val_accuracy = run.evaluate(model, val_loader, device, amp)
        run.record_epoch(result, log, train_loss, val_loss, val_accuracy, timer.seconds)
    result = run.finish_result(result, log, model, dataset, device)
    result["stages"] = [None] * world_size  # training only: run.evaluate() runs the whole model
    dist.all_gather_object(result["stages"], {"stage": rank, "busy_s": clock["busy"], "idle_s":
                                              sum(result["epoch_seconds"]) - clock["busy"]})
    log("\n".join(f"stage {s['stage']}: busy {s['busy_s']:.2f} s, idle {s['idle_s']:.2f} s"
                   for s in result["stages"]))
    return model, result


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    parser.add_argument("--micro-batches", type=run.positive_int, default=4,
                        help="pieces per batch")
    return run.add_common_arguments(parser, launched=True).parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        stages, blocks = int(os.environ.get("WORLD_SIZE", 1)), SIZES[args.size]["n_layer"]
        if blocks % stages or args.batch_size % args.micro_batches or args.micro_batches < stages:
            raise ValueError(f"{stages} stage(s) must split {blocks} blocks evenly, and "
                             f"{args.micro_batches} micro-batches (one per stage or more) must "
                             f"divide the batch of {args.batch_size}")
        if args.compile:  # dynamo cuts its graphs at each of the clock's hooks
            raise ValueError("--compile: the stages' busy clock does not go into compiled graphs")
        rank, world_size, device = run.setup(args.backend, __file__)
    except ValueError as err:
        return run.refuse(__file__, err)
    torch.set_num_threads(args.threads)
    log = run.rank_zero_log(rank)  # progress from rank 0 only
    model, result = fit(device, size=args.size, epochs=args.epochs, batch_size=args.batch_size,
                        lr=args.lr, seed=args.seed, train_windows=args.train_windows,
                        bf16=args.bf16, micro_batches=args.micro_batches,
                        sample_length=args.sample_length, log=log)
    return run.end_run(args, result, model.state_dict(), rank)


if __name__ == "__main__":
    sys.exit(main())
