"""Lesson 00's train.py with the model cut in two: half of its blocks on each of two devices.

    python lessons/02_model_parallel/train.py                  # the best pair this machine has
    python lessons/02_model_parallel/train.py --devices cuda:0,cuda:1 --micro-batches 4

The activations cross from one device to the other once per forward, their gradient once per
backward. --micro-batches M cuts each batch into M pieces so the devices can work at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
from gpt import GPT, SIZES, CharDataset, GPTConfig, parameter_digest, train_val_split  # noqa: E402


def choose_device(requested: str = "auto") -> torch.device:
    """The one place the device is decided; everything after this only uses the answer."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise ValueError(f"device {requested!r} is unknown; try cpu, cuda or cuda:1") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {requested!r}: this script runs on cpu or cuda")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and gpus == 0:
        why = ("this torch build has no CUDA support" if torch.version.cuda is None
               else "no CUDA GPU is visible to this process")
        raise ValueError(f"device {requested!r}: {why} (torch {torch.__version__}); "
                         "use cpu or auto")
    if device.type == "cuda" and (device.index or 0) >= gpus:
        raise ValueError(f"device {requested!r}: this machine has {gpus} GPU(s), "
                         f"cuda:0 to cuda:{gpus - 1}")
    return device


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


def sync(devices) -> None:
    """Wait for both devices' queued work: CUDA kernels run asynchronously to Python."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def make_loaders(train_set, val_set, batch_size: int, seed: int, device: torch.device):
    # Pinned (page-locked) host memory is what lets a host-to-GPU copy run asynchronously.
    pin = device.type == "cuda"
    # The shuffle has its own generator: the batch order depends on --seed and nothing else.
    order = torch.Generator().manual_seed(seed)
    train_loader = DataLoader(train_set, batch_size, shuffle=True, generator=order, pin_memory=pin)
    val_loader = DataLoader(val_set, batch_size=batch_size, shuffle=False, pin_memory=pin)
    return train_loader, val_loader


def next_char_loss(model, inputs, targets, bf16: bool, reduction: str = "mean"):
    """Logits for every position, and the cross-entropy of predicting each next character."""
    with torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits, _ = model(inputs)
    targets = targets.to(logits.device)  # the loss is computed where the model ends
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction=reduction)
    return logits, loss


def train_one_epoch(model, loader, optimizer, device, bf16: bool = False,
                    micro_batches: int = 1) -> float:
    """One pass over ``loader``; returns the mean training loss per sample."""
    model.train()
    # Summed where the loss is (a tensor from the first step on): a .item() per step would
    # make the CPU wait for the GPU every step.
    loss_sum, seen = 0.0, 0
    for inputs, targets in loader:
        # non_blocking: with pinned memory the copy overlaps with work already queued on the GPU.
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        # Each piece's forward is queued before any backward: on two GPUs the second runs piece
        # k while the first runs k + 1. Weighted by size, the pieces sum to the batch's mean loss.
        pieces = zip(inputs.chunk(micro_batches), targets.chunk(micro_batches), strict=True)
        loss = sum(next_char_loss(model, x, y, bf16)[1] * len(x) / len(inputs) for x, y in pieces)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach() * targets.shape[0]
        seen += targets.shape[0]
    return (loss_sum / seen).item()


def evaluate(model, loader, device, bf16: bool = False) -> tuple[float, float]:
    """Exact mean loss per character and next-character accuracy, however the batches fall."""
    was_training = model.training
    model.eval()
    loss_sum, correct, seen = 0.0, 0, 0  # tensors on the device after the first batch
    with torch.no_grad():
        for inputs, targets in loader:
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            # A sum, not a mean: the short last batch must weigh by its size, not as a full one.
            logits, loss = next_char_loss(model, inputs, targets, bf16, reduction="sum")
            loss_sum += loss
            correct += (logits.argmax(dim=-1) == targets.to(logits.device)).sum()
            seen += targets.numel()
    model.train(was_training)
    return (loss_sum / seen).item(), (correct / seen).item()


def sample(model, dataset: CharDataset, device, length: int = 60) -> str:
    """``length`` characters generated after a newline, always from the same random draws."""
    start = torch.tensor([dataset.encode("\n")], device=device)
    ids = model.generate(start, length, generator=torch.Generator().manual_seed(0))
    return dataset.decode(ids[0, 1:])


def save_checkpoint(model, path: Path) -> None:
    """Write to a temporary name, then rename: a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(model.state_dict(), partial)
    os.replace(partial, path)


def fit(devices, size: str = "tiny", epochs: int = 3, batch_size: int = 16,
        lr: float = 3e-3, seed: int = 0, train_windows: int | None = None, bf16: bool = False,
        compile: bool = False, micro_batches: int = 1, log=print):
    """Train from scratch on ``devices``; returns (model, result dict)."""
    dataset = CharDataset(SIZES[size]["block_size"])
    train_set, val_set = train_val_split(dataset)
    if train_windows:  # a quick run: the first windows only
        train_set = Subset(train_set, range(min(train_windows, len(train_set))))
    device = devices[0]  # where the batches go in
    train_loader, val_loader = make_loaders(train_set, val_set, batch_size, seed, device)

    # Built on the CPU from its own seeded generator, then moved: the same start on any device.
    model = GPT(GPTConfig.named(size, vocab_size=dataset.vocab_size), seed=seed)
    model = split_across(model, devices)
    # Created after the move, so the optimizer's state is allocated on the device as well.
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    # The compiled module shares its parameters with `model`; we keep `model` for saving.
    step_model = torch.compile(model) if compile else model

    where = (f"blocks 0-{len(model.blocks) // 2 - 1}; the rest on {devices[1]}, "
             f"{micro_batches} micro-batch(es)")
    log(f"device {device} ({where}), torch {torch.__version__}, {len(train_set)} train / "
        f"{len(val_set)} val windows of {dataset.block_size} characters, "
        f"{model.num_parameters():,} parameters, seed {seed}")
    result = {"devices": list(map(str, devices)), "micro_batches": micro_batches,
              "size": size, "seed": seed, "epochs": epochs,
              "batch_size": batch_size, "lr": lr, "bf16": bf16, "compile": compile,
              "torch": torch.__version__, "sample_before": sample(model, dataset, device),
              "train_loss": [], "val_loss": [], "val_accuracy": [], "epoch_seconds": []}
    log(f"sample before training: {result['sample_before']!r}")
    for epoch in range(1, epochs + 1):
        sync(devices)  # start the clock with nothing still queued from before
        start = time.perf_counter()
        train_loss = train_one_epoch(step_model, train_loader, optimizer, device, bf16,
                                     micro_batches)
        sync(devices)  # stop it only when the GPU has really finished the epoch
        seconds = time.perf_counter() - start
        val_loss, val_accuracy = evaluate(step_model, val_loader, device, bf16)
        for key, value in (("train_loss", train_loss), ("val_loss", val_loss),
                           ("val_accuracy", val_accuracy), ("epoch_seconds", seconds)):
            result[key].append(value)
        log(f"epoch {epoch}/{epochs}  train loss {train_loss:.4f}  val loss {val_loss:.4f}  "
            f"val acc {val_accuracy:6.1%}  {len(train_set) / seconds:9,.0f} samples/s")

    # The first epoch pays one-off costs (CUDA start-up, kernel selection, compilation).
    steady = result["epoch_seconds"][1:] or result["epoch_seconds"]
    result["samples_per_s"] = len(train_set) * len(steady) / sum(steady)
    result["sample_after"] = sample(model, dataset, device)
    result["params_sha256"] = parameter_digest(model)
    log(f"sample after training:  {result['sample_after']!r}")
    log(f"throughput {result['samples_per_s']:,.0f} samples/s"
        f"{' (first epoch excluded as warm-up)' if epochs > 1 else ''}; "
        f"parameters sha256 {result['params_sha256'][:16]}...")
    return model, result


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default=None,
                        help="two devices, e.g. cuda:0,cuda:1 (default: the best pair here)")
    parser.add_argument("--micro-batches", type=positive_int, default=1)
    parser.add_argument("--size", default="tiny", choices=["tiny", "gpu"],
                        help="tiny (default): 56k parameters; gpu: 14M, worth a GPU")
    parser.add_argument("--epochs", type=positive_int, default=3)
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument("--lr", type=positive_float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-windows", type=positive_int, default=None,
                        help="train on the first N windows only (quick runs; default: all)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="CPU threads (default 1: the tiny model's matrices are too small "
                             "to share out)")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--checkpoint", type=Path, help="save the trained weights here")
    parser.add_argument("--result", type=Path, help="write the result as JSON to this path")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        devices = ([choose_device(name) for name in args.devices.split(",")] if args.devices
                   else pick_device_pair())
        if len(devices) != 2:
            raise ValueError(f"--devices {args.devices}: expected two, like cuda:0,cuda:1")
    except ValueError as err:
        print(f"{Path(__file__).name}: error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    model, result = fit(devices, size=args.size, epochs=args.epochs, batch_size=args.batch_size,
                        lr=args.lr, seed=args.seed, train_windows=args.train_windows,
                        bf16=args.bf16, compile=args.compile, micro_batches=args.micro_batches)
    if args.checkpoint is not None:
        save_checkpoint(model, args.checkpoint)
        print(f"checkpoint saved to {args.checkpoint}")
    if args.result is not None:
        args.result.parent.mkdir(parents=True, exist_ok=True)
        args.result.write_text(json.dumps(result, indent=2) + "\n")
        print(f"result written to {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
