"""Lesson 00's train.py with the model cut in two: half of its blocks on each of two devices.

    python lessons/02_model_parallel/train.py                  # the best pair this machine has
    python lessons/02_model_parallel/train.py --devices cuda:0,cuda:1 --micro-batches 4

The activations cross from one device to the other once per forward, their gradient once per
backward. --micro-batches M cuts each batch into M pieces so the devices can work at once.
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


def pick_device_pair() -> tuple[torch.device, torch.device]:
    """Two GPUs if there are two, else one GPU and the CPU, else the CPU twice."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    pair = ("cuda:0", "cuda:1") if gpus >= 2 else ("cuda:0", "cpu") if gpus == 1 else ("cpu", "cpu")
    return torch.device(pair[0]), torch.device(pair[1])


def split_across(model: GPT, devices) -> GPT:
    """Embeddings and the first half of the blocks on devices[0]; the rest on devices[1]."""
    half = len(model.blocks) // 2
    for module in (model.tok_emb, model.pos_emb, *model.blocks[:half]):
        module.to(devices[0])
    for module in (*model.blocks[half:], model.ln_f, model.lm_head):
        module.to(devices[1])
    # The one crossing: before the second half, the activations move to its device. Autograd
    # records the copy, so backward sends their gradient back to devices[0] by itself.
    model.blocks[half].register_forward_pre_hook(lambda _, args: (args[0].to(devices[1]),))
    return model


def make_loaders(train_set, val_set, batch_size: int, seed: int, device: torch.device):
    # Pinned (page-locked) host memory is what lets a host-to-GPU copy run asynchronously.
    pin = device.type == "cuda"
    # The shuffle has its own generator: the batch order depends on --seed and nothing else.
    order = torch.Generator().manual_seed(seed)
    train_loader = DataLoader(train_set, batch_size, shuffle=True, generator=order, pin_memory=pin)
    val_loader = DataLoader(val_set, batch_size=batch_size, shuffle=False, pin_memory=pin)
    return train_loader, val_loader


def train_one_epoch(model, loader, optimizer, devices, amp=None, micro_batches: int = 1) -> float:
    """One pass over ``loader``; returns the mean training loss per sample."""
    model.train()
    # Summed where the loss is (a tensor from the first step on): a .item() per step would
    # make the CPU wait for the GPU every step.
    loss_sum, seen = 0.0, 0
    for inputs, targets in loader:
        # non_blocking: with pinned memory the copy overlaps with work already queued on the GPU.
        inputs = inputs.to(devices[0], non_blocking=True)
        targets = targets.to(devices[-1], non_blocking=True)  # where the loss is computed
        # Each piece's forward is queued before any backward: on two GPUs the second runs piece
        # k while the first runs k + 1. Weighted by size, the pieces sum to the batch's mean loss.
        pieces = zip(inputs.chunk(micro_batches), targets.chunk(micro_batches), strict=True)
        loss = sum(run.next_char_loss(model, x, y, amp)[1] * len(x) / len(inputs)
                   for x, y in pieces)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach() * targets.shape[0]
        seen += targets.shape[0]
    return (loss_sum / seen).item()


def fit(devices, size: str = "tiny", epochs: int = 3, batch_size: int = 16,
        lr: float = 3e-3, seed: int = 0, train_windows: int | None = None, bf16: bool = False,
        compile: bool = False, micro_batches: int = 1,
        sample_length: int = 60, log=print):
    """Train from scratch on ``devices``; returns (model, result dict)."""
    dataset, train_set, val_set = run.windows(size, train_windows)
    device = devices[0]  # where the batches go in
    train_loader, val_loader = make_loaders(train_set, val_set, batch_size, seed, device)

    # Built on the CPU from its own seeded generator, then moved: the same start on any device.
    model = GPT(GPTConfig.named(size, vocab_size=dataset.vocab_size), seed=seed)
    model = split_across(model, devices)
    # Created after the move, so the optimizer's state is allocated on the device as well.
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    # The compiled module shares its parameters with `model`; we keep `model` for saving.
    step_model = torch.compile(model) if compile else model
    amp = torch.bfloat16 if bf16 else None

    where = (f"blocks 0-{len(model.blocks) // 2 - 1}; the rest on {devices[1]}, "
             f"{micro_batches} micro-batch(es)")
    result = run.begin_result(log, device, where, model, dataset, train_set, val_set, sample_length,
                              devices=list(map(str, devices)), micro_batches=micro_batches,
                              size=size, seed=seed, epochs=epochs, batch_size=batch_size,
                              lr=lr, bf16=bf16, compile=compile)
    for _ in range(epochs):
        with run.timed(*devices) as timer:  # every device's queued work included
            train_loss = train_one_epoch(step_model, train_loader, optimizer, devices, amp,
                                         micro_batches)
        val_loss, val_accuracy = run.evaluate(step_model, val_loader, device, amp)
        run.record_epoch(result, log, train_loss, val_loss, val_accuracy, timer.seconds)
    return model, run.finish_result(result, log, model, dataset, device)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default=None,
                        help="two devices, e.g. cuda:0,cuda:1 (default: the best pair here)")
    parser.add_argument("--micro-batches", type=run.positive_int, default=1)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    return run.add_common_arguments(parser).parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        devices = ([run.choose_device(name) for name in args.devices.split(",")] if args.devices
                   else pick_device_pair())
        if len(devices) != 2:
            raise ValueError(f"--devices {args.devices}: expected two, like cuda:0,cuda:1")
    except ValueError as err:
        return run.refuse(__file__, err)
    torch.set_num_threads(args.threads)
    model, result = fit(devices, size=args.size, epochs=args.epochs, batch_size=args.batch_size,
                        lr=args.lr, seed=args.seed, train_windows=args.train_windows,
                        bf16=args.bf16, compile=args.compile, micro_batches=args.micro_batches,
                        sample_length=args.sample_length)
    return run.end_run(args, result, model.state_dict())


if __name__ == "__main__":
    sys.exit(main())
