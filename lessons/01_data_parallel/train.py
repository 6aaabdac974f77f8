"""Lesson 00's train.py with nn.DataParallel: one process drives every GPU of the machine.

    python lessons/01_data_parallel/train.py                   # every GPU (on one: [0, 0])
    python lessons/01_data_parallel/train.py --size gpu --device-ids 0,1 --batch-size 256

Every step, DataParallel copies the model to each GPU, cuts the batch into one chunk per GPU,
runs the chunks in threads and adds the gradients up on the first GPU. --batch-size is the
global batch. Without a CUDA GPU DataParallel calls the model directly: the run is lesson 00's.
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
from torch import nn
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


def sync(device: torch.device) -> None:
    """Wait for the device's queued work: CUDA kernels run asynchronously to Python."""
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
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction=reduction)
    return logits, loss


def train_one_epoch(model, loader, optimizer, device, bf16: bool = False) -> float:
    """One pass over ``loader``; returns the mean training loss per sample."""
    model.train()
    # Summed where the loss is (a tensor from the first step on): a .item() per step would
    # make the CPU wait for the GPU every step.
    loss_sum, seen = 0.0, 0
    for inputs, targets in loader:
        # non_blocking: with pinned memory the copy overlaps with work already queued on the GPU.
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        _, loss = next_char_loss(model, inputs, targets, bf16)
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
            correct += (logits.argmax(dim=-1) == targets).sum()
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


def fit(device: torch.device, size: str = "tiny", epochs: int = 3, batch_size: int = 16,
        lr: float = 3e-3, seed: int = 0, train_windows: int | None = None, bf16: bool = False,
        device_ids=None, log=print):
    """Train from scratch on ``device``; returns (model, result dict)."""
    dataset = CharDataset(SIZES[size]["block_size"])
    train_set, val_set = train_val_split(dataset)
    if train_windows:  # a quick run: the first windows only
        train_set = Subset(train_set, range(min(train_windows, len(train_set))))
    train_loader, val_loader = make_loaders(train_set, val_set, batch_size, seed, device)

    # Built on the CPU from its own seeded generator, then moved: the same start on any device.
    model = GPT(GPTConfig.named(size, vocab_size=dataset.vocab_size), seed=seed).to(device)
    # Created after the move, so the optimizer's state is allocated on the device as well.
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    # The model must sit on device_ids[0]: DataParallel replicates it from there at every step.
    # (No --compile in this step: the replicas are new modules each step.)
    step_model = nn.DataParallel(model, device_ids=device_ids)

    where = (f"DataParallel over GPUs {step_model.device_ids}" if device.type == "cuda"
             else "no CUDA GPU, so nn.DataParallel is a pass-through")
    log(f"device {device} ({where}), torch {torch.__version__}, {len(train_set)} train / "
        f"{len(val_set)} val windows of {dataset.block_size} characters, "
        f"{model.num_parameters():,} parameters, seed {seed}")
    result = {"device": str(device), "size": size, "seed": seed, "epochs": epochs,
              "batch_size": batch_size, "lr": lr, "bf16": bf16,
              "device_ids": step_model.device_ids,
              "torch": torch.__version__, "sample_before": sample(model, dataset, device),
              "train_loss": [], "val_loss": [], "val_accuracy": [], "epoch_seconds": []}
    log(f"sample before training: {result['sample_before']!r}")
    for epoch in range(1, epochs + 1):
        sync(device)  # start the clock with nothing still queued from before
        start = time.perf_counter()
        train_loss = train_one_epoch(step_model, train_loader, optimizer, device, bf16)
        sync(device)  # stop it only when the GPU has really finished the epoch
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


def parse_device_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU indices like 0,1; got {text}") from None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto",
                        help="auto (default): cuda if available, else cpu; or cpu, cuda, cuda:N")
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
    parser.add_argument("--device-ids", type=parse_device_ids, default=None,
                        help="GPUs to use, e.g. 0,1 (default: every GPU; on one GPU: 0,0)")
    parser.add_argument("--checkpoint", type=Path, help="save the trained weights here")
    parser.add_argument("--result", type=Path, help="write the result as JSON to this path")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        device = choose_device(args.device)
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus and device.type != "cuda":  # DataParallel takes every GPU unless told which
            raise ValueError("with GPUs here, nn.DataParallel runs on them: drop --device cpu, "
                             "or run lessons/00_single_gpu/train.py --device cpu")
        # On one GPU, [0, 0]: two replicas on the same GPU, to see the mechanics.
        device_ids = args.device_ids or (list(range(gpus)) if gpus > 1 else [0, 0])
        if args.bf16 and gpus:  # each replica's thread re-enters autocast without the dtype
            raise ValueError("--bf16: DataParallel's replica threads would autocast to float16 "
                             "(torch/nn/parallel/parallel_apply.py); lesson 03's DDP does bf16")
        if gpus and not all(0 <= i < gpus for i in device_ids):
            raise ValueError(f"--device-ids {device_ids}: this machine has GPUs 0 to {gpus - 1}")
        if device.type == "cuda":
            device = torch.device("cuda", device_ids[0])
    except ValueError as err:
        print(f"{Path(__file__).name}: error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    model, result = fit(device, size=args.size, epochs=args.epochs, batch_size=args.batch_size,
                        lr=args.lr, seed=args.seed, train_windows=args.train_windows,
                        bf16=args.bf16, device_ids=device_ids if device.type == "cuda" else None)
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
