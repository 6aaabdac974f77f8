"""train_checkpoint.py, checkpointing every few steps and resuming mid-epoch: it survives.

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 \
        lessons/09_survive_and_scale_out/train_resilient.py --checkpoint-dir ckpt --save-every 3

--fp16 computes in float16 under autocast with a GradScaler: the loss is scaled up before
backward so that small gradients do not flush to zero, and scaled back before the step, which is
skipped when a gradient overflowed. The scaler's state is part of the training state: the
checkpoint holds it beside the weights. --bf16 needs no scaler (bf16 has fp32's range).

After each epoch ckpt/step-<N>/train.pt gets the model, optimizer, learning-rate schedule,
GradScaler, position and every rank's generators, under a name one rename makes complete.
Started again, it resumes from the newest and ends bitwise equal to a run that never stopped.

--save-every N checkpoints after every N steps, with the place inside the epoch; the sampler
resumes there. --crash-at-step S kills the last rank after step S (first attempt only):
torchrun --max-restarts=1 starts the group again and the script resumes, bitwise exact.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import signal
import sys
import time
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
from gpt import GPT, SIZES, CharDataset, GPTConfig, parameter_digest, train_val_split  # noqa: E402
from gpt.run import replace_directory, rng_state, set_rng_state  # noqa: E402


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


LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def setup(backend: str = "auto") -> tuple[int, int, torch.device]:
    """Join the launcher's process group (no launcher: a group of one): rank, world, device."""
    missing = [name for name in LAUNCHER_VARIABLES if name not in os.environ]
    if 0 < len(missing) < len(LAUNCHER_VARIABLES):
        raise ValueError(f"the launcher did not set {missing}; start with: "
                         "torchrun --standalone --nproc-per-node=N train_ddp.py")
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":  # nccl only when every process on this machine has a GPU of its own
        backend = "nccl" if gpus >= local_world_size else "gloo"
    if backend == "nccl" and gpus < local_world_size:
        raise ValueError(f"--backend nccl needs CUDA GPUs, one per process: {local_world_size} "
                         f"processes on this machine, {gpus} GPU(s) visible; use gloo")
    device = choose_device(f"cuda:{os.getenv('LOCAL_RANK', 0)}" if backend == "nccl" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before anything else touches CUDA
    timeout = datetime.timedelta(seconds=60)  # a missing peer becomes an error, not a hang
    if not missing:
        dist.init_process_group(backend, timeout=timeout)  # reads the variables above
    else:  # a store on port 0: the OS picks a free port
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def sync(device: torch.device) -> None:
    """Wait for the device's queued work: CUDA kernels run asynchronously to Python."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ResumableSampler(DistributedSampler):
    """DistributedSampler whose epoch can start at this rank's ``start``-th sample."""

    start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        super().set_epoch(epoch)
        self.start = start

    def __iter__(self):  # the epoch's order depends on (seed, epoch, rank, world) alone
        return iter(list(super().__iter__())[self.start:])

    def __len__(self) -> int:
        return self.num_samples - self.start


def make_loaders(train_set, val_set, batch_size: int, seed: int, device: torch.device):
    # Pinned (page-locked) host memory is what lets a host-to-GPU copy run asynchronously.
    pin = device.type == "cuda"
    # Each rank takes its 1/world of the indices, shuffled from `seed` and the epoch alike.
    sampler = ResumableSampler(train_set, shuffle=True, seed=seed)
    # Generators of their own: each new iterator draws a seed from one, which must not move
    # the global generator's dropout draws when an epoch is resumed half-way.
    train_loader = DataLoader(train_set, batch_size, sampler=sampler, pin_memory=pin,
                              generator=torch.Generator())
    val_loader = DataLoader(val_set, batch_size=batch_size, shuffle=False, pin_memory=pin,
                            generator=torch.Generator())
    return train_loader, val_loader


def next_char_loss(model, inputs, targets, amp: torch.dtype | None, reduction: str = "mean"):
    """Logits for every position, and the cross-entropy of predicting each next character."""
    with torch.autocast(inputs.device.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
        logits, _ = model(inputs)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction=reduction)
    return logits, loss


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
        _, loss = next_char_loss(model, inputs, targets, amp)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # DDP all-reduces the scaled gradients' buckets
        scaler.step(optimizer)  # unscales; skips the step if a gradient is inf or nan
        scaler.update()  # a smaller scale after an overflow, a larger one after a calm run
        scheduler.step()  # the learning rate of the next step
        position.update(start=position["start"] + targets.shape[0], step=position["step"] + 1)
        after_step(position)  # now and then a checkpoint; a crash when asked for one
        loss_sum += loss.detach() * targets.shape[0]
        seen += targets.shape[0]
    totals = torch.stack([loss_sum, torch.tensor(float(seen), device=device)])
    dist.all_reduce(totals)  # every rank's share of the epoch
    return (totals[0] / totals[1]).item()


def evaluate(model, loader, device, amp=None) -> tuple[float, float]:
    """Exact mean loss per character and next-character accuracy, however the batches fall."""
    was_training = model.training
    model.eval()
    loss_sum, correct, seen = 0.0, 0, 0  # tensors on the device after the first batch
    with torch.no_grad():
        for inputs, targets in loader:
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            # A sum, not a mean: the short last batch must weigh by its size, not as a full one.
            logits, loss = next_char_loss(model, inputs, targets, amp, reduction="sum")
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


def save_state(path: Path, parts: dict, position: dict) -> None:
    """Rank 0 writes <path>.partial/train.pt, with every rank's generators, then renames it."""
    generators = [None] * dist.get_world_size()  # each rank's: they draw different masks
    dist.all_gather_object(generators, rng_state())  # bytes: map_location cannot move them
    if dist.get_rank() == 0:
        partial = path.with_name(path.name + ".partial")
        partial.mkdir(parents=True, exist_ok=True)  # an earlier crash's is overwritten
        torch.save({**{name: part.state_dict() for name, part in parts.items()},
                    "position": position, "generators": generators}, partial / "train.pt")
        replace_directory(partial, path)  # fsynced, then renamed: whole or not at all
    dist.barrier()  # no rank goes on before it is there


def resume_point(folder: Path) -> Path | None:
    """The newest step-<N>/ whose train.pt is whole (a zip archive's index is written last)."""
    found = [path for path in folder.glob("step-*") if path.name[5:].isdigit()
             and zipfile.is_zipfile(path / "train.pt")]
    return max(found, key=lambda path: int(path.name[5:]), default=None)


def load_state(path: Path, parts: dict, device) -> dict:
    state = torch.load(path / "train.pt", map_location=device, weights_only=True)
    for name, part in parts.items():
        part.load_state_dict(state[name])
    set_rng_state(state["generators"][dist.get_rank()])  # this rank's own, CUDA's too
    return state["position"]


def save_checkpoint(model, scaler, path: Path) -> None:
    """Write to a temporary name, then rename: a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save({"model": model.state_dict(), "scaler": scaler.state_dict()}, partial)
    os.replace(partial, path)


def fit(device: torch.device, size: str = "tiny", epochs: int = 3, batch_size: int = 16,
        lr: float = 3e-3, seed: int = 0, train_windows: int | None = None, bf16: bool = False,
        compile: bool = False, fp16: bool = False, comm_hook: str = "none", ddp_options=None,
        dropout: float = 0.0, checkpoint_dir: Path | None = None, save_every: int = 0,
        crash_at_step: int = 0, log=print):
    """Train from scratch on ``device``; returns (model, result dict)."""
    dataset = CharDataset(SIZES[size]["block_size"])
    train_set, val_set = train_val_split(dataset)
    if train_windows:  # a quick run: the first windows only
        train_set = Subset(train_set, range(min(train_windows, len(train_set))))
    train_loader, val_loader = make_loaders(train_set, val_set, batch_size, seed, device)

    # Built on the CPU from its own seeded generator, then moved: the same start on any device.
    config = GPTConfig.named(size, vocab_size=dataset.vocab_size, dropout=dropout)
    model = GPT(config, seed=seed).to(device)
    # Created after the move, so the optimizer's state is allocated on the device as well.
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs * len(train_loader))
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    **(ddp_options or {}))
    if comm_hook == "bf16":  # torch's hook, under a name DDP accepts on any build (lesson 08)
        ddp_model.register_comm_hook(
            None, lambda state, bucket: default_hooks.bf16_compress_hook(state, bucket))
    amp = torch.float16 if fp16 else torch.bfloat16 if bf16 else None
    scaler = torch.amp.GradScaler(device.type, enabled=fp16)  # disabled: passes steps through
    # The compiled module shares its parameters with `model`; we keep `model` for saving.
    step_model = torch.compile(ddp_model) if compile else ddp_model

    where = (f"world size {dist.get_world_size()}, backend {dist.get_backend()}, global batch "
             f"{dist.get_world_size()} x {batch_size}")
    log(f"device {device} ({where}), torch {torch.__version__}, {len(train_set)} train / "
        f"{len(val_set)} val windows of {dataset.block_size} characters, "
        f"{model.num_parameters():,} parameters, seed {seed}")
    result = {"world_size": dist.get_world_size(), "backend": dist.get_backend(),
              "device": str(device), "size": size, "seed": seed, "epochs": epochs,
              "batch_size": batch_size, "lr": lr, "bf16": bf16, "compile": compile,
              "fp16": fp16, "comm_hook": comm_hook, "ddp_options": ddp_options or {},
              "torch": torch.__version__, "sample_before": sample(model, dataset, device),
              "train_loss": [], "val_loss": [], "val_accuracy": [], "epoch_seconds": []}
    log(f"sample before training: {result['sample_before']!r}")
    torch.manual_seed(seed + dist.get_rank())  # each rank draws its own dropout masks
    parts = dict(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
    position = {"epoch": 1, "start": 0, "step": 0}  # start: this rank's samples done this epoch
    resume = resume_point(checkpoint_dir) if checkpoint_dir else None
    if resume is not None:
        position = load_state(resume, parts, device)
        log(f"resumed from {resume}: epoch {position['epoch']}, step {position['step']}")

    def after_step(position: dict) -> None:
        if position["start"] == train_loader.sampler.num_samples:  # the epoch is done
            position.update(epoch=position["epoch"] + 1, start=0)
        every = position["step"] % save_every == 0 if save_every else position["start"] == 0
        if checkpoint_dir is not None and every:  # every N steps, or at the end of each epoch
            save_state(checkpoint_dir / f"step-{position['step']:08d}", parts, position)
        rank, first_try = dist.get_rank(), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if position["step"] == crash_at_step and first_try and rank == dist.get_world_size() - 1:
            print(f"rank {rank}: killing itself after step {crash_at_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # no clean-up, no exit code: a lost machine
    for epoch in range(position["epoch"], epochs + 1):
        sync(device)  # start the clock with nothing still queued from before
        start = time.perf_counter()
        # A new shuffle each epoch, the same on all ranks; a resumed epoch from where it was.
        train_loader.sampler.set_epoch(epoch, position["start"])
        train_loss = train_one_epoch(step_model, train_loader, optimizer, scheduler, scaler,
                                     device, amp, position, after_step)
        sync(device)  # stop it only when the GPU has really finished the epoch
        seconds = time.perf_counter() - start
        val_loss, val_accuracy = evaluate(step_model, val_loader, device, amp)
        for key, value in (("train_loss", train_loss), ("val_loss", val_loss),
                           ("val_accuracy", val_accuracy), ("epoch_seconds", seconds)):
            result[key].append(value)
        log(f"epoch {epoch}/{epochs}  train loss {train_loss:.4f}  val loss {val_loss:.4f}  "
            f"val acc {val_accuracy:6.1%}  {len(train_set) / seconds:9,.0f} samples/s")

    # The first epoch pays one-off costs (CUDA start-up, kernel selection, compilation).
    steady = result["epoch_seconds"][1:] or result["epoch_seconds"]
    result["samples_per_s"] = len(train_set) * len(steady) / (sum(steady) or float("inf"))
    result["sample_after"] = sample(model, dataset, device)
    result["params_sha256"] = parameter_digest(model)
    result["scaler"] = scaler.state_dict()  # empty when disabled
    log(f"sample after training:  {result['sample_after']!r}")
    log(f"throughput {result['samples_per_s']:,.0f} samples/s"
        f"{' (first epoch excluded as warm-up)' if epochs > 1 else ''}; "
        f"parameters sha256 {result['params_sha256'][:16]}...")
    return model, scaler, result


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
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                        help="auto (default): nccl with a GPU per process, else gloo")
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
    parser.add_argument("--fp16", action="store_true", help="float16 autocast with a GradScaler")
    parser.add_argument("--comm-hook", default="none", choices=["none", "bf16"],
                        help="bf16: all-reduce the gradients in bfloat16")
    parser.add_argument("--bucket-cap-mb", type=positive_float, help="DDP's bucket size")
    parser.add_argument("--gradient-as-bucket-view", action="store_true")
    parser.add_argument("--checkpoint", type=Path, help="save the trained weights here")
    parser.add_argument("--checkpoint-dir", type=Path, help="resume from, and save into, here")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--save-every", type=positive_int,
                        help="steps between checkpoints (default: one after every epoch)")
    parser.add_argument("--crash-at-step", type=positive_int, default=0,
                        help="the last rank kills itself after this step (first attempt only)")
    parser.add_argument("--result", type=Path, help="write the result as JSON to this path")
    parser.add_argument("--local-rank", "--local_rank", type=int)  # torch.distributed.launch's
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.bf16 and args.fp16:
        print(f"{Path(__file__).name}: error: choose --bf16 or --fp16, not both", file=sys.stderr)
        return 2
    try:
        rank, world_size, device = setup(args.backend)
    except ValueError as err:
        print(f"{Path(__file__).name}: error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    log = print if rank == 0 else (lambda *args, **kwargs: None)  # progress from rank 0 only
    where = " ".join(f"{name}={os.environ.get(name, '-')}" for name in (
        "RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"))
    # Every rank: who it is, where it runs. One write, so that lines of processes that share a
    # terminal (two torchruns on one machine) stay whole.
    print(f"{where} device={device}\n", end="", flush=True)
    options = {"gradient_as_bucket_view": args.gradient_as_bucket_view,
               **({"bucket_cap_mb": args.bucket_cap_mb} if args.bucket_cap_mb else {})}
    model, scaler, result = fit(
        device, size=args.size, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
        seed=args.seed, train_windows=args.train_windows, bf16=args.bf16, compile=args.compile,
        fp16=args.fp16, comm_hook=args.comm_hook, ddp_options=options, dropout=args.dropout,
        checkpoint_dir=args.checkpoint_dir, save_every=args.save_every or 0,
        crash_at_step=args.crash_at_step, log=log)
    if args.checkpoint is not None and rank == 0:  # the copies are equal: one writer is enough
        save_checkpoint(model, scaler, args.checkpoint)
        print(f"checkpoint saved to {args.checkpoint}")
    dist.barrier()  # no rank goes on (or reads the checkpoint) before it is complete
    gc.collect()  # DDP's reference cycles hold the group: free them before destroying it
    dist.destroy_process_group()
    if args.result is not None and rank == 0:
        args.result.parent.mkdir(parents=True, exist_ok=True)
        args.result.write_text(json.dumps(result, indent=2) + "\n")
        print(f"result written to {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
