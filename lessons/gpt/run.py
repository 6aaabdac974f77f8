"""The plumbing of a training run that no lesson teaches, shared by every lesson's script.

A lesson's script keeps what its lesson changes (how the processes start, how the model is
wrapped or split, the training loop); what every run needs the same way lives here, once, so
that the diff between two steps of the chain is the lesson and nothing else. Lesson 00 explains
each piece (lesson 03, ``setup``). A script imports the module and calls it by name, so that a
reader sees at a glance which lines are shared::

    from gpt import GPT, GPTConfig, run
    device = run.choose_device(args.device)

- The device: :func:`choose_device` (lesson 00's task0_1, whose reference answer is kept
  identical to it) and :func:`sync`, which waits for a GPU's queued work before a clock is read.
- The process group: :func:`setup`, which lesson 03 teaches line by line and every script from
  lesson 03 on starts with, and :func:`device_mesh`, ``init_device_mesh``'s mesh whose every
  group waits no longer than the default group (lesson 06).
- The loss and its measurement: :func:`next_char_loss`, :func:`evaluate`, :func:`sample`.
- The data: :func:`windows`, the running example's train and validation windows.
- The record of a run: :func:`begin_result`, :func:`record_epoch`, :func:`finish_result` build
  the result every script returns and logs; :func:`write_result` writes it as JSON;
  :func:`timed` times an epoch; :func:`bytes_per_rank` reports what each rank stores
  (:func:`local_part`: this rank's part of a DTensor).
- The end of a run: :func:`end_run` saves the checkpoint and the result, and leaves the process
  group (lesson 03 explains each line).
- The command line: :func:`add_common_arguments` (the flags every script takes, spelt one way,
  and with ``launched=True`` those of a script a launcher starts),
  :func:`positive_int`, :func:`non_negative_int`, :func:`positive_float`, :func:`refuse` (an
  error that names the script),
  :func:`rank_zero_log` (progress printed by one process only).
- Files that must survive a crash and a power loss: :func:`save_checkpoint`,
  :func:`sync_to_disk` and :func:`replace_directory` (lesson 09 explains why each step is there).
- Generator states a checkpoint can carry to any device: :func:`rng_state` and
  :func:`set_rng_state`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import Subset

from .data import CharDataset, train_val_split
from .model import SIZES, parameter_digest


def choose_device(requested: str | None = None) -> torch.device:
    """Turn a device request into a ``torch.device``, once, at the start of a program.

    - ``None`` or ``"auto"``: ``cuda`` if ``torch.cuda.is_available()``, else ``cpu``;
    - ``"cpu"``: the CPU;
    - ``"cuda"`` or ``"cuda:N"``: that device; but raise ``ValueError`` when CUDA is not
      available (with a message that names ``'cpu'`` as the way out), or when N is not below
      ``count = torch.cuda.device_count()`` (with a message that gives the valid range,
      ``cuda:0`` to ``cuda:<count - 1>``, and names no other index above it but N);
    - anything else (``"gpu"``, ``"tpu"``, ``""``, ``"cuda:x"``): ``ValueError``.

    Ask ``torch.cuda.is_available()`` / ``torch.cuda.device_count()`` when called: the test
    replaces them to imitate machines with and without GPUs, and checks every case above.
    """
    if requested is None or requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cpu":
        return torch.device("cpu")
    if requested == "cuda" or requested.startswith("cuda:"):
        try:
            device = torch.device(requested)
        except RuntimeError:
            raise ValueError(f"bad device {requested!r}: write 'cuda' or 'cuda:N'") from None
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA support" if torch.version.cuda is None
                   else "no CUDA GPU is visible to this process")
            raise ValueError(f"{requested!r} was requested but {why} (torch {torch.__version__}); "
                             "use 'cpu', or 'auto' to take a GPU only when there is one")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"{requested!r} was requested but this machine has {count} "
                             f"CUDA device(s): use cuda:0 .. cuda:{count - 1}")
        return device
    raise ValueError(f"unknown device {requested!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'")


# --8<-- [start:setup]
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TIMEOUT = datetime.timedelta(seconds=60)  # a missing peer becomes an error, not a hang


def setup(backend: str, script: str) -> tuple[int, int, torch.device]:
    """Join the launcher's process group (no launcher: a group of one): rank, world, device.
    Lesson 03 explains each line; every script from lesson 03 on starts with it. ``script``
    (the caller's ``__file__``) names the script in the advice to start it under torchrun."""
    missing = [name for name in LAUNCHER_VARIABLES if name not in os.environ]
    if 0 < len(missing) < len(LAUNCHER_VARIABLES):
        raise ValueError(f"the launcher did not set {missing}; start with: torchrun "
                         f"--standalone --nproc-per-node=N {Path(script).name}")
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
    if not missing:
        dist.init_process_group(backend, timeout=TIMEOUT)  # reads the variables above
    else:  # a store on port 0: the OS picks a free port
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=TIMEOUT)
    return dist.get_rank(), dist.get_world_size(), device
# --8<-- [end:setup]


# --8<-- [start:device_mesh]
def mesh_groups(shape: tuple[int, ...]) -> list:
    """This process's group along each dimension of a mesh of ``shape``, every one waiting at
    most :data:`TIMEOUT`. Rank ``r`` sits where ``r`` sits in ``torch.arange(world).view(shape)``,
    as with ``init_device_mesh``; a dimension over every rank is the default group, as there."""
    world = dist.get_world_size()
    if math.prod(shape) != world:
        raise ValueError(f"a mesh of shape {tuple(shape)} has {math.prod(shape)} places for "
                         f"{world} processes")
    layout = torch.arange(world).view(shape)
    groups = []
    for dim in range(len(shape)):  # the rank lists along `dim`: that axis last, the rest flat
        lists = layout.movedim(dim, -1).reshape(-1, shape[dim]).tolist()
        groups.append(dist.group.WORLD if shape[dim] == world else
                      dist.new_subgroups_by_enumeration(lists, timeout=TIMEOUT)[0])
    return groups


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]):
    """``init_device_mesh(device_type, shape, mesh_dim_names=names)``, but over
    :func:`mesh_groups`: ``init_device_mesh`` gives the groups of a dimension that does not span
    every rank the backend's default timeout, not the default group's (unless its
    ``backend_override`` passes options that carry one), so on gloo they wait 30 minutes for a
    missing peer (tests/test_torch_claims.py asks torch)."""
    from torch.distributed.device_mesh import DeviceMesh

    groups = mesh_groups(shape)  # first: it refuses a shape that does not hold every rank
    layout = torch.arange(dist.get_world_size()).view(shape)
    return DeviceMesh.from_group(groups, device_type, mesh=layout, mesh_dim_names=names)
# --8<-- [end:device_mesh]


def sync(device: torch.device) -> None:
    """Wait for the device's queued work: CUDA kernels run asynchronously to Python."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """What :func:`timed` yields: ``seconds`` is set when the block ends."""

    seconds = 0.0


@contextlib.contextmanager
def timed(*devices: torch.device):
    """Time the block, in seconds of the wall clock (``time.perf_counter``). The clock starts
    with nothing still queued on ``devices`` from before, and stops only when they have really
    finished the block's work (:func:`sync`; lesson 00 explains why both are needed)."""
    timer = Timer()
    for device in devices:
        sync(device)
    start = time.perf_counter()
    yield timer
    for device in devices:
        sync(device)
    timer.seconds = time.perf_counter() - start


def windows(size: str, train_windows: int | None = None):
    """The running example's data for a model ``size``: (dataset, train windows, val windows).
    ``train_windows`` keeps only the first N training windows (a quick run)."""
    dataset = CharDataset(SIZES[size]["block_size"])
    train_set, val_set = train_val_split(dataset)
    if train_windows:
        train_set = Subset(train_set, range(min(train_windows, len(train_set))))
    return dataset, train_set, val_set


def next_char_loss(model, inputs, targets, amp: torch.dtype | None = None,
                   reduction: str = "mean", positions: torch.Tensor | None = None):
    """Logits for every position, and the cross-entropy of predicting each next character.
    ``amp``: the autocast dtype (``torch.bfloat16``, ``torch.float16``), or None for none. The
    targets meet the logits where the model put them (a model split across devices ends on
    its last one; elsewhere this moves nothing). ``positions``: where the inputs' tokens sit in
    their sequences, for the model, when they are not all of it (lesson 10)."""
    given = {} if positions is None else {"positions": positions}
    with torch.autocast(inputs.device.type, dtype=amp, enabled=amp is not None):
        logits, _ = model(inputs, **given)
    targets = targets.to(logits.device)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction=reduction)
    return logits, loss


def evaluate(model, loader, device, amp: torch.dtype | None = None,
             positions: torch.Tensor | None = None) -> tuple[float, float]:
    """Exact mean loss per character and next-character accuracy, however the batches fall.
    ``positions``: as for :func:`next_char_loss`."""
    was_training = model.training
    model.eval()
    loss_sum, correct, seen = 0.0, 0, 0  # tensors on the device after the first batch
    with torch.no_grad():
        for inputs, targets in loader:
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            # A sum, not a mean: the short last batch must weigh by its size, not as a full one.
            logits, loss = next_char_loss(model, inputs, targets, amp, "sum", positions)
            loss_sum += loss
            correct += (logits.argmax(dim=-1) == targets.to(logits.device)).sum()
            seen += targets.numel()
    model.train(was_training)
    return (loss_sum / seen).item(), (correct / seen).item()


def sample(model, dataset: CharDataset, device, length: int = 60) -> str:
    """``length`` characters generated after a newline, always from the same random draws (a
    shorter sample is the start of a longer one); ``""`` for 0, without running the model."""
    if length == 0:
        return ""
    start = torch.tensor([dataset.encode("\n")], device=device)
    ids = model.generate(start, length, generator=torch.Generator().manual_seed(0))
    return dataset.decode(ids[0, 1:])


def begin_result(log, device, where: str, model, dataset, train_set, val_set,
                 sample_length: int = 60, **settings) -> dict:
    """Log what is about to run and start its record: the ``settings`` it was given (with the
    group's world size and backend, once there is a process group), torch's version, a sample
    of ``sample_length`` characters from the untrained model (the same length again after
    training; each character is a forward, so a quick run asks for few or none), and empty
    per-epoch lists."""
    log(f"device {device} ({where}), torch {torch.__version__}, {len(train_set)} train / "
        f"{len(val_set)} val windows of {dataset.block_size} characters, "
        f"{model.num_parameters():,} parameters, seed {settings.get('seed')}")
    if dist.is_initialized():  # every process's run is part of one group's
        settings = {"world_size": dist.get_world_size(), "backend": dist.get_backend(),
                    **settings}
    result = {**settings, "device": str(device), "torch": torch.__version__,
              "train_samples": len(train_set), "sample_length": sample_length,
              "sample_before": sample(model, dataset, device, sample_length),
              "train_loss": [], "val_loss": [], "val_accuracy": [], "epoch_seconds": []}
    log(f"sample before training: {result['sample_before']!r}")
    return result


def record_epoch(result: dict, log, train_loss: float, val_loss: float, val_accuracy: float,
                 seconds: float, epoch: int | None = None) -> None:
    """Add one epoch's numbers to ``result`` and log them. ``epoch`` (counted from 1) is the
    number of the epoch recorded so far unless given: a resumed run starts past the first."""
    for key, value in (("train_loss", train_loss), ("val_loss", val_loss),
                       ("val_accuracy", val_accuracy), ("epoch_seconds", seconds)):
        result[key].append(value)
    epoch = len(result["train_loss"]) if epoch is None else epoch
    log(f"epoch {epoch}/{result['epochs']}  train loss {train_loss:.4f}  "
        f"val loss {val_loss:.4f}  val acc {val_accuracy:6.1%}  "
        f"{result['train_samples'] / seconds:9,.0f} samples/s")


def finish_result(result: dict, log, model, dataset, device, weights=None) -> dict:
    """Close the record: throughput, a sample from the trained model, the parameters' digest
    (of ``weights``, a whole state dict, where the model holds only shards of its own). The
    first epoch pays one-off costs (CUDA start-up, kernel selection, compilation), so the
    throughput leaves it out when there are more; a run resumed after its last epoch timed
    none and reports 0."""
    steady = result["epoch_seconds"][1:] or result["epoch_seconds"]
    result["samples_per_s"] = result["train_samples"] * len(steady) / (sum(steady) or math.inf)
    result["sample_after"] = sample(model, dataset, device, result["sample_length"])
    result["params_sha256"] = parameter_digest(model if weights is None else weights)
    log(f"sample after training:  {result['sample_after']!r}")
    log(f"throughput {result['samples_per_s']:,.0f} samples/s"
        f"{' (first epoch excluded as warm-up)' if len(result['epoch_seconds']) > 1 else ''}; "
        f"parameters sha256 {result['params_sha256'][:16]}...")
    return result


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (its local shard); a plain tensor itself."""
    # Not imported here at the top: importing DTensor costs each process about a second, and a
    # script that never imported it has no DTensor.
    dtensor = sys.modules.get("torch.distributed.tensor")
    return tensor.to_local() if dtensor and isinstance(tensor, dtensor.DTensor) else tensor


def bytes_per_rank(model, optimizer, device, log=print) -> list[dict[str, int]]:
    """What each rank stores, gathered from every rank (a collective: all must call it) and
    logged: the bytes of its own part (a DTensor's local shard, else the whole tensor) of the
    parameters, gradients and optimizer state, and on a GPU its peak allocated, activations and
    buffers included. Call it with FSDP's parameters resharded: gathered ones count whole."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    moments = [v for state in optimizer.state.values() for v in state.values() if v.dim()]
    sizes = {name: sum(local_part(t).nbytes for t in tensors) for name, tensors in (
        ("parameters", model.parameters()), ("gradients", grads), ("optimizer_state", moments))}
    if device.type == "cuda":
        sizes["peak_allocated"] = torch.cuda.max_memory_allocated(device)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, sizes)
    for rank, stored in enumerate(every):
        log(f"rank {rank} stores " + ", ".join(f"{k.replace('_', ' ')} {v / 1e3:,.1f} kB"
                                               for k, v in stored.items()))
    return every


def write_result(result: dict, path: Path, log=print) -> None:
    """The result as JSON, for scripts and tests to read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    log(f"result written to {path}")


# --8<-- [start:end_run]
def end_run(args: argparse.Namespace, result: dict, checkpoint=None, rank: int = 0) -> int:
    """The end of every run: rank 0 saves ``checkpoint`` (what ``torch.save`` takes) to
    ``--checkpoint`` and writes ``result`` to ``--result``. In a process group, every rank waits
    until the checkpoint is complete, then leaves the group. Returns the exit code, 0."""
    # One writer: DDP's copies are equal; a sharded run gathered the whole model on rank 0.
    if args.checkpoint is not None and rank == 0:
        save_checkpoint(checkpoint, args.checkpoint)
    if dist.is_initialized():
        dist.barrier()  # no rank goes on (or reads the checkpoint) before it is complete
        gc.collect()  # a DDP (FSDP) model left in reference cycles holds the group: free it first
        dist.destroy_process_group()
    if args.result is not None and rank == 0:
        write_result(result, args.result)
    return 0
# --8<-- [end:end_run]


def save_checkpoint(state, path: Path, log=print) -> None:
    """``torch.save(state)`` to a temporary name, then rename: a crash never leaves half a file
    under ``path`` (lesson 09 adds what a power loss needs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(state, partial)
    os.replace(partial, path)
    log(f"checkpoint saved to {path}")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def add_common_arguments(parser: argparse.ArgumentParser,
                         launched: bool = False) -> argparse.ArgumentParser:
    """The flags every training script of the course takes, each spelt one way; ``launched``:
    also those of a script that a launcher starts (lesson 03 on): ``--backend`` for
    :func:`setup`, and ``--local-rank`` (and ``--local_rank``), which the older
    ``python -m torch.distributed.launch`` passes to every process (lesson 03)."""
    if launched:
        parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                            help="auto (default): nccl with a GPU per process, else gloo")
        parser.add_argument("--local-rank", "--local_rank", type=int)
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES),
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
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--sample-length", type=non_negative_int, default=60,
                        help="characters to generate before and after training (default 60; "
                             "each is one forward of the model; 0: none)")
    parser.add_argument("--checkpoint", type=Path, help="save the trained weights here")
    parser.add_argument("--result", type=Path, help="write the result as JSON to this path")
    return parser


def refuse(script: str, err: Exception | str) -> int:
    """Print ``<script>: error: <err>`` to stderr, as argparse does, and return exit code 2."""
    print(f"{Path(script).name}: error: {err}", file=sys.stderr)
    return 2


def quiet(*args, **kwargs) -> None:
    """A ``log`` that prints nothing."""


def rank_zero_log(rank: int):
    """``print`` on rank 0, :func:`quiet` elsewhere: progress from one process, not from W."""
    return print if rank == 0 else quiet


def sync_to_disk(path: str | os.PathLike) -> None:
    """``os.fsync`` a file or a directory: its bytes (or its entries: the names in it) reach
    the disk before this returns, not only the operating system's cache. Where directories
    cannot be opened (Windows), a directory is left to the file system."""
    if Path(path).is_dir() and os.name == "nt":  # Windows opens no directory for fsync
        return
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def replace_directory(partial: str | os.PathLike, path: str | os.PathLike) -> None:
    """Make the finished directory ``partial`` appear as ``path``, whole or not at all, even
    across a power loss: fsync every file in it and the directory itself, rename it, then fsync
    the parent so that the rename is on the disk too. A ``path`` that exists already (the same
    step saved before a restart, perhaps broken) is renamed aside first and removed after: a
    rename cannot replace a directory that is not empty."""
    partial, path = Path(partial), Path(path)
    for file in partial.iterdir():
        if file.is_file():
            sync_to_disk(file)
    sync_to_disk(partial)
    if path.exists():
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        os.replace(partial, path)
        shutil.rmtree(old)
    else:
        os.replace(partial, path)
    sync_to_disk(path.parent)


def rng_state() -> dict:
    """This process's generator states: torch's CPU one, Python's, and CUDA's once in use.

    torch's states are kept as ``bytes``, not tensors: ``torch.load(..., map_location=device)``
    moves every tensor of a file to ``device``, and ``torch.set_rng_state`` (CUDA's too) takes
    a CPU ``ByteTensor`` only, so tensor states loaded onto a GPU could not be restored.
    """
    state = {"torch": bytes(torch.get_rng_state().tolist()), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [bytes(s.tolist()) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned."""
    def byte_tensor(data: bytes) -> torch.Tensor:  # a CPU ByteTensor, as set_rng_state needs
        return torch.tensor(list(data), dtype=torch.uint8)

    torch.set_rng_state(byte_tensor(state["torch"]))
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all([byte_tensor(s) for s in state["cuda"]])
