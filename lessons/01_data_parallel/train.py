"""Lesson 00's train.py with nn.DataParallel: one process drives every GPU of the machine.

    python lessons/01_data_parallel/train.py                   # every GPU (on one: [0, 0])
    python lessons/01_data_parallel/train.py --size gpu --device-ids 0,1 --batch-size 256

Every step, DataParallel copies the model to each GPU, cuts the batch into one chunk per GPU,
runs the chunks in threads and adds the gradients up on the first GPU. --batch-size is the
global batch. Without a CUDA GPU DataParallel calls the model directly: the run is lesson 00's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
# gpt: the running example (model, data); gpt.run: the plumbing every step shares
from gpt import GPT, GPTConfig, run  # noqa: E402


def make_loaders(train_set, val_set, batch_size: int, seed: int, device: torch.device):
    # Pinned (page-locked) host memory is what lets a host-to-GPU copy run asynchronously.
    pin = device.type == "cuda"
    # The shuffle has its own generator: the batch order depends on --seed and nothing else.
    order = torch.Generator().manual_seed(seed)
    train_loader = DataLoader(train_set, batch_size, shuffle=True, generator=order, pin_memory=pin)
    val_loader = DataLoader(val_set, batch_size=batch_size, shuffle=False, pin_memory=pin)
    return train_loader, val_loader


def train_one_epoch(model, loader, optimizer, device, amp=None) -> float:
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
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach() * targets.shape[0]
        seen += targets.shape[0]
    return (loss_sum / seen).item()


def fit(device: torch.device, size: str = "tiny", epochs: int = 3, batch_size: int = 16,
        lr: float = 3e-3, seed: int = 0, train_windows: int | None = None, bf16: bool = False,
        device_ids=None,
        sample_length: int = 60, log=print):
    """Train from scratch on ``device``; returns (model, result dict)."""
    dataset, train_set, val_set = run.windows(size, train_windows)
    train_loader, val_loader = make_loaders(train_set, val_set, batch_size, seed, device)

    # Built on the CPU from its own seeded generator, then moved: the same start on any device.
    model = GPT(GPTConfig.named(size, vocab_size=dataset.vocab_size), seed=seed).to(device)
    # Created after the move, so the optimizer's state is allocated on the device as well.
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    # The model must sit on device_ids[0]: DataParallel replicates it from there at every step.
    step_model = nn.DataParallel(model, device_ids=device_ids)
    amp = torch.bfloat16 if bf16 else None

    where = (f"DataParallel over GPUs {step_model.device_ids}" if device.type == "cuda"
             else "no CUDA GPU, so nn.DataParallel is a pass-through")
    result = run.begin_result(log, device, where, model, dataset, train_set, val_set, sample_length,
                              size=size, seed=seed, epochs=epochs, batch_size=batch_size,
                              lr=lr, bf16=bf16, device_ids=step_model.device_ids)
    for _ in range(epochs):
        with run.timed(device) as timer:  # the device's queued work included
            train_loss = train_one_epoch(step_model, train_loader, optimizer, device, amp)
        val_loss, val_accuracy = run.evaluate(step_model, val_loader, device, amp)
        run.record_epoch(result, log, train_loss, val_loss, val_accuracy, timer.seconds)
    return model, run.finish_result(result, log, model, dataset, device)


def parse_device_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU indices like 0,1; got {text}") from None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto",
                        help="auto (default): cuda if available, else cpu; or cpu, cuda, cuda:N")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    parser.add_argument("--device-ids", type=parse_device_ids, default=None,
                        help="GPUs to use, e.g. 0,1 (default: every GPU; on one GPU: 0,0)")
    return run.add_common_arguments(parser).parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        device = run.choose_device(args.device)
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus and device.type != "cuda":  # DataParallel takes every GPU unless told which
            raise ValueError("with GPUs here, nn.DataParallel runs on them: drop --device cpu, "
                             "or run lessons/00_single_gpu/train.py --device cpu")
        # On one GPU, [0, 0]: two replicas on the same GPU, to see the mechanics.
        device_ids = args.device_ids or (list(range(gpus)) if gpus > 1 else [0, 0])
        if args.bf16 and gpus:  # each replica's thread re-enters autocast without the dtype
            raise ValueError("--bf16: DataParallel's replica threads would autocast to float16 "
                             "(torch/nn/parallel/parallel_apply.py); lesson 03's DDP does bf16")
        if args.compile:  # the replicas are new modules each step: nothing stays compiled
            raise ValueError("--compile: DataParallel builds new replicas of the model every "
                             "step (torch/nn/parallel/replicate.py); lesson 03's DDP compiles")
        if gpus and not all(0 <= i < gpus for i in device_ids):
            raise ValueError(f"--device-ids {device_ids}: this machine has GPUs 0 to {gpus - 1}")
        if device.type == "cuda":
            device = torch.device("cuda", device_ids[0])
    except ValueError as err:
        return run.refuse(__file__, err)
    torch.set_num_threads(args.threads)
    model, result = fit(device, size=args.size, epochs=args.epochs, batch_size=args.batch_size,
                        lr=args.lr, seed=args.seed, train_windows=args.train_windows,
                        bf16=args.bf16, device_ids=device_ids if device.type == "cuda" else None,
                        sample_length=args.sample_length)
    return run.end_run(args, result, model.state_dict())


if __name__ == "__main__":
    sys.exit(main())
