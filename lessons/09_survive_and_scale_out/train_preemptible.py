"""train_resilient.py, stopping when the scheduler says so: saved, it can be preempted.

    torchrun --standalone --nproc-per-node=2 \
        lessons/09_survive_and_scale_out/train_preemptible.py --checkpoint-dir ckpt --save-every 50

SIGTERM (a preempted or cancelled job) or SIGUSR1 (slurm/train.sbatch passes SLURM's warning
on: the time limit is near) sent to any rank stops every rank at the next step boundary: they
save that step and exit with 128 + the signal, 143 for SIGTERM. Started again, the run resumes
there, bitwise exact.

The rest is train_resilient.py's: --bf16 or --fp16 (its GradScaler saved), a checkpoint every
--save-every steps (or after each epoch) resumed bitwise, and --crash-at-step.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
# gpt: the running example (model, data); gpt.run: the plumbing every step shares;
# training_state (beside this file): the checkpoint, sampler and stop of lesson 09
import training_state  # noqa: E402
from gpt import GPT, GPTConfig, run  # noqa: E402


def make_loaders(train_set, val_set, batch_size: int, seed: int, device: torch.device):
    # Pinned (page-locked) host memory is what lets a host-to-GPU copy run asynchronously.
    pin = device.type == "cuda"
    # Each rank takes its 1/world of the indices, shuffled from `seed` and the epoch alike.
    sampler = training_state.ResumableSampler(train_set, shuffle=True, seed=seed)
    # Generators of their own: each new iterator draws a seed from one, which must not move
    # the global generator's dropout draws when an epoch is resumed half-way.
    train_loader = DataLoader(train_set, batch_size, sampler=sampler, pin_memory=pin,
                              generator=torch.Generator())
    val_loader = DataLoader(val_set, batch_size=batch_size, shuffle=False, pin_memory=pin,
                            generator=torch.Generator())
    return train_loader, val_loader


def train_one_epoch(model, loader, optimizer, scheduler, scaler, device, amp=None,
                    position=None, after_step=None) -> float:
    """The rest of the epoch in ``loader``; returns the mean training loss per sample."""
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
        position.update(start=position["start"] + targets.shape[0], step=position["step"] + 1)
        after_step(position)  # now and then a checkpoint; a crash when asked for one
    totals = torch.stack([loss_sum, torch.tensor(float(seen), device=device)])
    dist.all_reduce(totals)  # every rank's share of the epoch
    return (totals[0] / totals[1]).item()


def fit(device: torch.device, size: str = "tiny", epochs: int = 3, batch_size: int = 16,
        lr: float = 3e-3, seed: int = 0, train_windows: int | None = None, bf16: bool = False,
        compile: bool = False, fp16: bool = False, dropout: float = 0.0,
        checkpoint_dir: Path | None = None, save_every: int = 0,
        crash_at_step: int = 0, stop: training_state.Preemption | None = None,
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
    position = {"epoch": 1, "start": 0, "step": 0}  # start: this rank's samples done this epoch
    resume = training_state.resume_point(checkpoint_dir) if checkpoint_dir else None
    if resume is not None:
        position = training_state.load(resume, parts, device)
        log(f"resumed from {resume}: epoch {position['epoch']}, step {position['step']}")

    control = training_state.cpu_group()  # the stop flag's: asking never waits for the GPU's step

    def after_step(position: dict) -> None:
        if position["start"] == train_loader.sampler.num_samples:  # the epoch is done
            position.update(epoch=position["epoch"] + 1, start=0)
        every = position["step"] % save_every == 0 if save_every else position["start"] == 0
        stopping = stop is not None and stop.requested(control)  # every rank the same answer
        if checkpoint_dir is not None and (every or stopping):  # every N steps, or each epoch
            training_state.save(checkpoint_dir / f"step-{position['step']:08d}", parts, position)
        if stopping:
            log(f"{signal.Signals(stop.signal).name}: stopped after step {position['step']}"
                f"{', saved' if checkpoint_dir else ', nothing saved (no --checkpoint-dir)'}; "
                f"exit code {stop.exit_code}")
            raise SystemExit(stop.exit_code)  # the group is left in main()
        rank = dist.get_rank()
        first_try = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if position["step"] == crash_at_step and first_try and rank == dist.get_world_size() - 1:
            print(f"rank {rank}: killing itself after step {crash_at_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, no exit code: a lost machine
    for epoch in range(position["epoch"], epochs + 1):
        with run.timed(device) as timer:  # the device's queued work included
            # A new shuffle each epoch, the same on all ranks; a resumed epoch from where it was.
            train_loader.sampler.set_epoch(epoch, position["start"])
            train_loss = train_one_epoch(step_model, train_loader, optimizer, scheduler, scaler,
                                         device, amp, position, after_step)
        val_loss, val_accuracy = run.evaluate(step_model, val_loader, device, amp)
        run.record_epoch(result, log, train_loss, val_loss, val_accuracy, timer.seconds, epoch)
    result["scaler"] = scaler.state_dict()  # empty when disabled
    return model, run.finish_result(result, log, model, dataset, device)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    parser.add_argument("--fp16", action="store_true", help="float16 autocast with a GradScaler")
    parser.add_argument("--checkpoint-dir", type=Path, help="resume from, and save into, here")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--save-every", type=run.positive_int,
                        help="steps between checkpoints (default: one after every epoch)")
    parser.add_argument("--crash-at-step", type=run.positive_int, default=0,
                        help="the last rank kills itself after this step (first attempt only)")
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
    training_state.say_who(device)  # every rank: its ranks, its attempt, its device
    try:
        # SIGTERM or SIGUSR1: every rank stops at the next step boundary, saved
        with training_state.Preemption() as stop:
            model, result = fit(
                device, size=args.size, epochs=args.epochs, batch_size=args.batch_size,
                lr=args.lr, seed=args.seed, train_windows=args.train_windows, bf16=args.bf16,
                compile=args.compile, fp16=args.fp16, dropout=args.dropout,
                checkpoint_dir=args.checkpoint_dir, save_every=args.save_every or 0,
                crash_at_step=args.crash_at_step, stop=stop,
                sample_length=args.sample_length, log=log)
    except SystemExit:  # stopped by a signal: every rank leaves the group, then exits
        dist.destroy_process_group()
        raise
    weights = {"model": model.state_dict(), "scaler": result["scaler"]}
    return run.end_run(args, result, weights, rank)


if __name__ == "__main__":
    sys.exit(main())
