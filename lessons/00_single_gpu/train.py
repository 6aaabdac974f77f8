"""Train a small classifier on one device, done right.

    python lessons/00_single_gpu/train.py                      # CUDA if there is one, else CPU
    python lessons/00_single_gpu/train.py --device cpu --epochs 3 --result runs/r.json
    python lessons/00_single_gpu/train.py --bf16 --compile     # the speed switches

One file, top to bottom: a synthetic data set, a model, one epoch of training, an exact
validation pass, honest throughput, and a machine-readable result that tests can read.
The later lessons spread this same script over many devices.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# The task: points in IN_FEATURES dimensions, labelled by a fixed random "teacher" network.
# It is the same task whatever --seed says: --seed changes only this run's own randomness
# (the initial weights and the order of the batches).
DATA_SEED = 1234
IN_FEATURES, TEACHER_HIDDEN, N_CLASSES = 8, 16, 4
HIDDEN = 128  # the student's width: much bigger than the teacher's, as in real life
N_TRAIN = 4096
N_VAL = 1000  # not a multiple of the batch size, so the last validation batch is short


def make_dataset(n_train: int = N_TRAIN, n_val: int = N_VAL, seed: int = DATA_SEED):
    """Train and validation sets of (float32 features [N, IN_FEATURES], int64 labels [N]).

    Generated on the CPU from its own generator, so it is bit-for-bit the same on every machine
    and does not depend on (or disturb) the global random state.
    """
    g = torch.Generator().manual_seed(seed)
    teacher_in = torch.randn(IN_FEATURES, TEACHER_HIDDEN, generator=g) / IN_FEATURES**0.5
    teacher_out = torch.randn(TEACHER_HIDDEN, N_CLASSES, generator=g)
    x = torch.randn(n_train + n_val, IN_FEATURES, generator=g)
    y = (torch.tanh(x @ teacher_in) @ teacher_out).argmax(dim=1)
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


def build_model(hidden: int = HIDDEN) -> nn.Module:
    return nn.Sequential(
        nn.Linear(IN_FEATURES, hidden), nn.GELU(),
        nn.Linear(hidden, hidden), nn.GELU(),
        nn.Linear(hidden, N_CLASSES),
    )


def choose_device(requested: str = "auto") -> torch.device:
    """The one place the device is decided; everything after this only uses the answer."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        why = ("this torch build has no CUDA support" if torch.version.cuda is None
               else "no CUDA GPU is visible to this process")
        raise ValueError(f"--device cuda: {why} (torch {torch.__version__}); "
                         "use --device cpu or --device auto")
    return torch.device(requested)


def seed_everything(seed: int) -> None:
    """Seed every global generator this script draws from (model init uses torch's)."""
    random.seed(seed)
    torch.manual_seed(seed)  # seeds the CPU and every CUDA device


def sync(device: torch.device) -> None:
    """Wait for the device's queued work: CUDA kernels run asynchronously to Python."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_loaders(train_set, val_set, batch_size: int, seed: int, device: torch.device):
    # Pinned (page-locked) host memory is what lets a host-to-GPU copy run asynchronously.
    pin = device.type == "cuda"
    # The shuffle has its own generator: the batch order depends on --seed and nothing else.
    order = torch.Generator().manual_seed(seed)
    train_loader = DataLoader(train_set, batch_size=batch_size, shuffle=True, generator=order,
                              pin_memory=pin)
    val_loader = DataLoader(val_set, batch_size=batch_size, shuffle=False, pin_memory=pin)
    return train_loader, val_loader


def train_one_epoch(model, loader, optimizer, device, bf16: bool = False) -> float:
    """One pass over ``loader``; returns the mean training loss per sample."""
    model.train()
    # Summed on the device: a .item() per step would make the CPU wait for the GPU every step.
    loss_sum = torch.zeros((), device=device)
    seen = 0
    for inputs, targets in loader:
        # non_blocking: with pinned memory the copy overlaps with work already queued on the GPU.
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach() * targets.shape[0]
        seen += targets.shape[0]
    return (loss_sum / seen).item()


def evaluate(model, loader, device, bf16: bool = False) -> tuple[float, float]:
    """Exact mean loss per sample and accuracy over ``loader``, however its batches fall."""
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    seen = 0
    with torch.no_grad():
        for inputs, targets in loader:
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = model(inputs)
            # A sum, not a mean: the short last batch must weigh by its size, not as a full one.
            loss_sum += F.cross_entropy(logits.float(), targets, reduction="sum")
            correct += (logits.argmax(dim=1) == targets).sum()
            seen += targets.shape[0]
    model.train(was_training)
    return (loss_sum / seen).item(), (correct / seen).item()


def parameter_digest(model: nn.Module) -> str:
    """sha256 of every parameter and buffer's name, dtype, shape and exact bytes."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        digest.update(bytes(t.reshape(-1).view(torch.uint8).tolist()))
    return digest.hexdigest()


def fit(device: torch.device, epochs: int = 5, batch_size: int = 64, lr: float = 1e-3,
        seed: int = 0, bf16: bool = False, compile: bool = False, log=print):
    """Train from scratch on ``device``; returns (model, result dict)."""
    seed_everything(seed)
    train_set, val_set = make_dataset()
    train_loader, val_loader = make_loaders(train_set, val_set, batch_size, seed, device)

    # Built on the CPU from the seeded generator, then moved: the same start on every device.
    model = build_model().to(device)
    # Created after the move, so the optimizer's state is allocated on the device as well.
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    # The compiled module shares its parameters with `model`; we keep `model` for saving.
    step_model = torch.compile(model) if compile else model

    n_params = sum(p.numel() for p in model.parameters())
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{torch.get_num_threads()} threads")
    log(f"device {device} ({where}), torch {torch.__version__}, {len(train_set)} train / "
        f"{len(val_set)} val samples, {n_params:,} parameters, seed {seed}")

    result = {"device": str(device), "seed": seed, "epochs": epochs, "batch_size": batch_size,
              "lr": lr, "bf16": bf16, "compile": compile, "torch": torch.__version__,
              "train_loss": [], "val_loss": [], "val_accuracy": [], "epoch_seconds": []}
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
    result["final_val_loss"] = result["val_loss"][-1]
    result["final_val_accuracy"] = result["val_accuracy"][-1]
    result["params_sha256"] = parameter_digest(model)
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
    parser = argparse.ArgumentParser(description="Train a small MLP classifier on one device.")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto (default): cuda if available, else cpu")
    parser.add_argument("--epochs", type=positive_int, default=5)
    parser.add_argument("--batch-size", type=positive_int, default=64)
    parser.add_argument("--lr", type=positive_float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--result", type=Path, help="write the result as JSON to this path")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        device = choose_device(args.device)
        if args.bf16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError("--bf16: this GPU has no bfloat16 support; run without --bf16")
    except ValueError as err:
        print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    _, result = fit(device, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                    seed=args.seed, bf16=args.bf16, compile=args.compile)
    if args.result is not None:
        args.result.parent.mkdir(parents=True, exist_ok=True)
        args.result.write_text(json.dumps(result, indent=2) + "\n")
        print(f"result written to {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
