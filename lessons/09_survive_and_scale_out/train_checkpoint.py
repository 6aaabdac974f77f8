"""Lesson 08's train_amp.py, checkpointing the whole training state after every epoch.

    torchrun --standalone --nproc-per-node=2 \
        lessons/09_survive_and_scale_out/train_checkpoint.py --checkpoint-dir ckpt --dropout 0.1

--fp16 computes in float16 under autocast with a GradScaler: the loss is scaled up before
backward so that small gradients do not flush to zero, and scaled back before the step, which is
skipped when a gradient overflowed. The scaler's state is part of the training state: the
checkpoint holds it beside the weights. --bf16 needs no scaler (bf16 has fp32's range).

After each epoch ckpt/step-<N>/train.pt gets the model, optimizer, learning-rate schedule,
GradScaler, position and every rank's generators, under a name one rename makes complete.
Started again, it resumes from the newest and ends bitwise equal to a run that never stopped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
# gpt: the running example (model, data); gpt.run: the plumbing every step shares;
# training_state (beside this file): the checkpoint, sampler and stop of lesson 09
import training_state  # noqa: E402
from gpt import GPT, GPTConfig, run  # noqa: E402


def make_loaders(train_set, val_set, batch_size: int, seed: int, device: torch.device):
    # Pinned (page-locked) host memory is what lets a host-to-GPU copy run asynchronously.
    pin = device.type == "cuda"
    # Each rank takes its 1/world of the indices, shuffled from `seed` and the epoch alike.
    sampler = DistributedSampler(train_set, shuffle=True, seed=seed)
    train_loader = DataLoader(train_set, batch_size, sampler=sampler, pin_memory=pin)
    val_loader = DataLoader(val_set, batch_size=batch_size, shuffle=False, pin_memory=pin)
    return train_loader, val_loader


def train_one_epoch(model, loader, optimizer, scheduler, scaler, device, amp=None) -> float:
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
        scheduler.step()  # the learning rate of the next step
        loss_sum += loss.detach() * targets.shape[0]
        seen += targets.shape[0]
    totals = torch.stack([loss_sum, torch.tensor(float(seen), device=device)])
    dist.all_reduce(totals)  # every rank's share of the epoch
    return (totals[0] / totals[1]).item()


def fit(device: torch.device, size: str = "tiny", epochs: int = 3, batch_size: int = 16,
        lr: float = 3e-3, seed: int = 0, train_windows: int | None = None, bf16: bool = False,
        compile: bool = False, fp16: bool = False, dropout: float = 0.0,
        checkpoint_dir: Path | None = None,
        sample_length: int = 60, log=print):
    """Train from scratch on ``device``; returns (model, result dict)."""
    dataset, train_set, val_set = run.windows(size, train_windows)
    train_loader, val_loader = make_loaders(train_set, val_set, batch_size, seed, device)

    # Built on the CPU from its own seeded generator, then moved: the same start on any device.
    config = GPTConfig.named(size, vocab_size=dataset.vocab_size, dropout=dropout)
    model = GPT(config, seed=seed).to(device)
    # Created after the move, so the optimizer's state is allocated on the device as well.
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs * len(train_loader))
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    # The compiled module shares its parameters with `model`; we keep `model` for saving.
    step_model = torch.compile(ddp_model) if compile else ddp_model
    amp = torch.float16 if fp16 else torch.bfloat16 if bf16 else None
    scaler = torch.amp.GradScaler(device.type, enabled=fp16)  # disabled: passes steps through

    where = (f"world size {dist.get_world_size()}, backend {dist.get_backend()}, global batch "
             f"{dist.get_world_size()} x {batch_size}")
    result = run.begin_result(log, device, where, model, dataset, train_set, val_set, sample_length,
                              size=size, seed=seed, epochs=epochs, batch_size=batch_size,
                              lr=lr, bf16=bf16, compile=compile, fp16=fp16)
    torch.manual_seed(seed + dist.get_rank())  # each rank draws its own dropout masks
    parts = dict(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
    position = {"epoch": 1, "step": 0}  # the next epoch to train, the steps taken
    resume = training_state.resume_point(checkpoint_dir) if checkpoint_dir else None
    if resume is not None:
        position = training_state.load(resume, parts, device)
        log(f"resumed from {resume}: epoch {position['epoch']}, step {position['step']}")
    for epoch in range(position["epoch"], epochs + 1):
        with run.timed(device) as timer:  # the device's queued work included
            train_loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on all ranks
            train_loss = train_one_epoch(step_model, train_loader, optimizer, scheduler, scaler,
                                         device, amp)
        val_loss, val_accuracy = run.evaluate(step_model, val_loader, device, amp)
        run.record_epoch(result, log, train_loss, val_loss, val_accuracy, timer.seconds, epoch)
        position = {"epoch": epoch + 1, "step": position["step"] + len(train_loader)}
        if checkpoint_dir is not None:
            training_state.save(checkpoint_dir / f"step-{position['step']:08d}", parts, position)
    result["scaler"] = scaler.state_dict()  # empty when disabled
    return model, run.finish_result(result, log, model, dataset, device)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    parser.add_argument("--fp16", action="store_true", help="float16 autocast with a GradScaler")
    parser.add_argument("--checkpoint-dir", type=Path, help="resume from, and save into, here")
    parser.add_argument("--dropout", type=float, default=0.0)
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
    model, result = fit(device, size=args.size, epochs=args.epochs, batch_size=args.batch_size,
                        lr=args.lr, seed=args.seed, train_windows=args.train_windows,
                        bf16=args.bf16, compile=args.compile, fp16=args.fp16,
                        dropout=args.dropout, checkpoint_dir=args.checkpoint_dir,
                        sample_length=args.sample_length, log=log)
    weights = {"model": model.state_dict(), "scaler": result["scaler"]}
    return run.end_run(args, result, weights, rank)


if __name__ == "__main__":
    sys.exit(main())
