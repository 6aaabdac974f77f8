"""Lesson 03's train_ddp.py with the settings lesson 08 measures: precision and communication.

    torchrun --standalone --nproc-per-node=2 lessons/08_measure_and_choose/train_amp.py --fp16
    torchrun ... train_amp.py --bf16 --comm-hook bf16 --gradient-as-bucket-view --compile

--fp16 computes in float16 under autocast with a GradScaler: the loss is scaled up before
backward so that small gradients do not flush to zero, and scaled back before the step, which is
skipped when a gradient overflowed. The scaler's state is part of the training state: the
checkpoint holds it beside the weights. --bf16 needs no scaler (bf16 has fp32's range).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
# gpt: the running example (model, data); gpt.run: the plumbing every step shares
from gpt import GPT, GPTConfig, run  # noqa: E402


def make_loaders(train_set, val_set, batch_size: int, seed: int, device: torch.device):
    # Pinned (page-locked) host memory is what lets a host-to-GPU copy run asynchronously.
    pin = device.type == "cuda"
    # Each rank takes its 1/world of the indices, shuffled from `seed` and the epoch alike.
    sampler = DistributedSampler(train_set, shuffle=True, seed=seed)
    train_loader = DataLoader(train_set, batch_size, sampler=sampler, pin_memory=pin)
    val_loader = DataLoader(val_set, batch_size=batch_size, shuffle=False, pin_memory=pin)
    return train_loader, val_loader


def train_one_epoch(model, loader, optimizer, scaler, device, amp=None) -> float:
    """One pass over ``loader``; returns the mean training loss per sample."""
    model.train()
    # Summed where the loss is (a tensor from the first step on): a .item() per step would
    # make the CPU wait for the GPU every step.
    loss_sum, seen = 0.0, 0
    for inputs, targets in loader:
        # non_blocking: with pinned memory the copy overlaps with work already queued on the GPU.
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        _, loss = run.next_char_loss(model, inputs, targets, amp)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # DDP all-reduces the scaled gradients' buckets
        scaler.step(optimizer)  # unscales; skips the step if a gradient is inf or nan
        scaler.update()  # a smaller scale after an overflow, a larger one after a calm run
        loss_sum += loss.detach() * targets.shape[0]
        seen += targets.shape[0]
    totals = torch.stack([loss_sum, torch.tensor(float(seen), device=device)])
    dist.all_reduce(totals)  # every rank's share of the epoch
    return (totals[0] / totals[1]).item()


def fit(device: torch.device, size: str = "tiny", epochs: int = 3, batch_size: int = 16,
        lr: float = 3e-3, seed: int = 0, train_windows: int | None = None, bf16: bool = False,
        compile: bool = False, fp16: bool = False, comm_hook: str = "none", ddp_options=None,
        sample_length: int = 60, log=print):
    """Train from scratch on ``device``; returns (model, result dict)."""
    dataset, train_set, val_set = run.windows(size, train_windows)
    train_loader, val_loader = make_loaders(train_set, val_set, batch_size, seed, device)

    # Built on the CPU from its own seeded generator, then moved: the same start on any device.
    model = GPT(GPTConfig.named(size, vocab_size=dataset.vocab_size), seed=seed).to(device)
    # Created after the move, so the optimizer's state is allocated on the device as well.
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    **(ddp_options or {}))
    if comm_hook == "bf16":  # torch's hook, under a name DDP accepts on any build (lesson 08)
        ddp_model.register_comm_hook(
            None, lambda state, bucket: default_hooks.bf16_compress_hook(state, bucket))
    # The compiled module shares its parameters with `model`; we keep `model` for saving.
    step_model = torch.compile(ddp_model) if compile else ddp_model
    amp = torch.float16 if fp16 else torch.bfloat16 if bf16 else None
    scaler = torch.amp.GradScaler(device.type, enabled=fp16)  # disabled: passes steps through

    where = (f"world size {dist.get_world_size()}, backend {dist.get_backend()}, global batch "
             f"{dist.get_world_size()} x {batch_size}")
    result = run.begin_result(log, device, where, model, dataset, train_set, val_set, sample_length,
                              size=size, seed=seed, epochs=epochs, batch_size=batch_size,
                              lr=lr, bf16=bf16, compile=compile, fp16=fp16, comm_hook=comm_hook,
                              ddp_options=ddp_options or {})
    for epoch in range(1, epochs + 1):
        with run.timed(device) as timer:  # the device's queued work included
            train_loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on all ranks
            train_loss = train_one_epoch(step_model, train_loader, optimizer, scaler, device, amp)
        val_loss, val_accuracy = run.evaluate(step_model, val_loader, device, amp)
        run.record_epoch(result, log, train_loss, val_loss, val_accuracy, timer.seconds)
    result["scaler"] = scaler.state_dict()  # empty when disabled
    return model, run.finish_result(result, log, model, dataset, device)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    parser.add_argument("--fp16", action="store_true", help="float16 autocast with a GradScaler")
    parser.add_argument("--comm-hook", default="none", choices=["none", "bf16"],
                        help="bf16: all-reduce the gradients in bfloat16")
    parser.add_argument("--bucket-cap-mb", type=run.positive_float, help="DDP's bucket size")
    parser.add_argument("--gradient-as-bucket-view", action="store_true")
    return run.add_common_arguments(parser, launched=True).parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.bf16 and args.fp16:
        return run.refuse(__file__, "choose --bf16 or --fp16, not both")
    try:
        rank, world_size, device = run.setup(args.backend, __file__)
    except ValueError as err:
        return run.refuse(__file__, err)
    torch.set_num_threads(args.threads)
    log = run.rank_zero_log(rank)  # progress from rank 0 only
    options = {"gradient_as_bucket_view": args.gradient_as_bucket_view,
               **({"bucket_cap_mb": args.bucket_cap_mb} if args.bucket_cap_mb else {})}
    model, result = fit(device, size=args.size, epochs=args.epochs, batch_size=args.batch_size,
                        lr=args.lr, seed=args.seed, train_windows=args.train_windows,
                        bf16=args.bf16, compile=args.compile, fp16=args.fp16,
                        comm_hook=args.comm_hook, ddp_options=options,
                        sample_length=args.sample_length, log=log)
    weights = {"model": model.state_dict(), "scaler": result["scaler"]}
    return run.end_run(args, result, weights, rank)


if __name__ == "__main__":
    sys.exit(main())
