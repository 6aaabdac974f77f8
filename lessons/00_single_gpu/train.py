"""Train the course's running example, a small GPT over characters, on one device, done right.

    python lessons/00_single_gpu/train.py                      # CUDA if there is one, else CPU
    python lessons/00_single_gpu/train.py --device cpu --epochs 1 --result runs/r.json
    python lessons/00_single_gpu/train.py --size gpu --bf16 --compile   # a size worth a GPU

The model, its data and the plumbing every run shares come from lessons/gpt. Lessons 01, 02
and 03 each change a few lines of this file; `diff` shows which: those lines are the lesson.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
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
        compile: bool = False,
        sample_length: int = 60, log=print):
    """Train from scratch on ``device``; returns (model, result dict)."""
    dataset, train_set, val_set = run.windows(size, train_windows)
    train_loader, val_loader = make_loaders(train_set, val_set, batch_size, seed, device)

    # Built on the CPU from its own seeded generator, then moved: the same start on any device.
    model = GPT(GPTConfig.named(size, vocab_size=dataset.vocab_size), seed=seed).to(device)
    # Created after the move, so the optimizer's state is allocated on the device as well.
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    # The compiled module shares its parameters with `model`; we keep `model` for saving.
    step_model = torch.compile(model) if compile else model
    amp = torch.bfloat16 if bf16 else None

    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{torch.get_num_threads()} thread(s)")
    result = run.begin_result(log, device, where, model, dataset, train_set, val_set, sample_length,
                              size=size, seed=seed, epochs=epochs, batch_size=batch_size,
                              lr=lr, bf16=bf16, compile=compile)
    for _ in range(epochs):
        with run.timed(device) as timer:  # the device's queued work included
            train_loss = train_one_epoch(step_model, train_loader, optimizer, device, amp)
        val_loss, val_accuracy = run.evaluate(step_model, val_loader, device, amp)
        run.record_epoch(result, log, train_loss, val_loss, val_accuracy, timer.seconds)
    return model, run.finish_result(result, log, model, dataset, device)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto",
                        help="auto (default): cuda if available, else cpu; or cpu, cuda, cuda:N")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    return run.add_common_arguments(parser).parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        device = run.choose_device(args.device)
    except ValueError as err:
        return run.refuse(__file__, err)
    torch.set_num_threads(args.threads)
    model, result = fit(device, size=args.size, epochs=args.epochs, batch_size=args.batch_size,
                        lr=args.lr, seed=args.seed, train_windows=args.train_windows,
                        bf16=args.bf16, compile=args.compile,
                        sample_length=args.sample_length)
    return run.end_run(args, result, model.state_dict())


if __name__ == "__main__":
    sys.exit(main())
