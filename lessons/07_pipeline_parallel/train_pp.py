"""Lesson 03's train_ddp.py as a pipeline: each process runs a stage of the model's blocks.

    torchrun --standalone --nproc-per-node=2 lessons/07_pipeline_parallel/train_pp.py  # 2 stages
    python lessons/07_pipeline_parallel/train_pp.py                        # 1 stage, no launcher

Every stage reads the same batches; torch's 1F1B schedule cuts each into --micro-batches and
sends activations forward, gradients back. --batch-size is the whole batch, read by every stage.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.utils.data import DataLoader, DistributedSampler, Subset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
import gpt  # noqa: E402 - for GPTStage
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


LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def setup(backend: str = "auto") -> tuple[int, int, torch.device]:
    """Join the launcher's process group (no launcher: a group of one): rank, world, device."""
    missing = [name for name in LAUNCHER_VARIABLES if name not in os.environ]
    if 0 < len(missing) < len(LAUNCHER_VARIABLES):
        raise ValueError(f"the launcher did not set {missing}; start with: "
                         "torchrun --standalone --nproc-per-node=N train_pp.py")
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


def make_loaders(train_set, val_set, batch_size: int, seed: int, device: torch.device):
    # Pinned (page-locked) host memory is what lets a host-to-GPU copy run asynchronously.
    pin = device.type == "cuda"
    # Every stage reads every index in one order, in whole batches: the schedule cuts each one.
    order = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=seed)
    train_loader = DataLoader(train_set, batch_size, sampler=order, pin_memory=pin, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=batch_size, shuffle=False, pin_memory=pin)
    return train_loader, val_loader


def next_char_loss(model, inputs, targets, bf16: bool, reduction: str = "mean"):
    """Logits for every position, and the cross-entropy of predicting each next character."""
    with torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits, _ = model(inputs)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction=reduction)
    return logits, loss


def train_one_epoch(schedule, loader, optimizer, device, bf16: bool = False) -> float:
    """One pass over ``loader``; returns the mean training loss per sample."""
    first, last = dist.get_rank() == 0, dist.get_rank() == dist.get_world_size() - 1
    # Summed where the loss is (a tensor from the first step on): a .item() per step would
    # make the CPU wait for the GPU every step.
    loss_sum, seen = torch.zeros((), device=device), 0  # a tensor on every stage
    for inputs, targets in loader:
        # non_blocking: with pinned memory the copy overlaps with work already queued on the GPU.
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        losses = []  # the last stage's, one per micro-batch
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):  # each stage gives
            schedule.step(*[inputs] * first, **dict(target=targets, losses=losses) if last else {})
        optimizer.step()  # this stage's parameters only
        loss_sum += torch.stack(losses).mean().detach() * len(targets) if last else 0
        seen += targets.shape[0]
    totals = torch.stack([loss_sum, torch.tensor(float(seen), device=device)])
    dist.broadcast(totals, src=dist.get_world_size() - 1)  # the last stage's numbers, to all
    return (totals[0] / totals[1]).item()


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


def busy_clock(module, device) -> dict[str, float]:
    clock = {"busy": 0.0, "started": 0.0}  # seconds computing: every forward and backward

    def tick(*args) -> None:  # 2 arguments for the pre-hooks, 3 forward's hook, 1 the grads'
        now = sync(device) or time.perf_counter()  # on a GPU, wait for its work first
        clock.update(busy=clock["busy"] + (len(args) != 2) * (now - clock["started"]), started=now)

    for register in (module.register_forward_pre_hook, module.register_forward_hook,
                     module.register_full_backward_pre_hook):
        register(tick)
    torch.autograd.graph.register_multi_grad_hook(list(module.parameters()), tick)  # ends backward
    return clock


def save_checkpoint(model, path: Path) -> None:
    """Write to a temporary name, then rename: a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(model.state_dict(), partial)
    os.replace(partial, path)


def fit(device: torch.device, size: str = "tiny", epochs: int = 3, batch_size: int = 16,
        lr: float = 3e-3, seed: int = 0, train_windows: int | None = None, bf16: bool = False,
        micro_batches: int = 4, log=print):
    """Train from scratch on ``device``; returns (model, result dict)."""
    dataset = CharDataset(SIZES[size]["block_size"])
    train_set, val_set = train_val_split(dataset)
    if train_windows:  # a quick run: the first windows only
        train_set = Subset(train_set, range(min(train_windows, len(train_set))))
    train_loader, val_loader = make_loaders(train_set, val_set, batch_size, seed, device)

    # Built on the CPU from its own seeded generator, then moved: the same start on any device.
    model = GPT(GPTConfig.named(size, vocab_size=dataset.vocab_size), seed=seed).to(device)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    per = len(model.blocks) // world_size  # equal runs of blocks: a stage per process
    stages = [gpt.GPTStage(model, s * per, (s + 1) * per) for s in range(world_size)]
    # Created after the move, so the optimizer's state is allocated on the device as well.
    optimizer = torch.optim.AdamW(stages[rank].parameters(), lr=lr)  # this stage's only
    clock = busy_clock(stages[rank], device)
    schedule = Schedule1F1B(PipelineStage(stages[rank], rank, world_size, device), micro_batches,
                            loss_fn=lambda logits, y: F.cross_entropy(logits.float().mT, y))

    where = f"{world_size} stage(s) of {per} block(s), batch {batch_size} in {micro_batches} pieces"
    log(f"device {device} ({where}), torch {torch.__version__}, {len(train_set)} train / "
        f"{len(val_set)} val windows of {dataset.block_size} characters, "
        f"{model.num_parameters():,} parameters, seed {seed}")
    result = {"world_size": dist.get_world_size(), "backend": dist.get_backend(),
              "device": str(device), "size": size, "seed": seed, "epochs": epochs,
              "batch_size": batch_size, "lr": lr, "bf16": bf16, "micro_batches": micro_batches,
              "torch": torch.__version__, "sample_before": sample(model, dataset, device),
              "train_loss": [], "val_loss": [], "val_accuracy": [], "epoch_seconds": []}
    log(f"sample before training: {result['sample_before']!r}")
    for epoch in range(1, epochs + 1):
        sync(device)  # start the clock with nothing still queued from before
        start = time.perf_counter()
        train_loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on all ranks
        train_loss = train_one_epoch(schedule, train_loader, optimizer, device, bf16)
        sync(device)  # stop it only when the GPU has really finished the epoch
        seconds = time.perf_counter() - start
        for owner, stage in enumerate(stages):  # each stage's trained weights to every rank,
            for p in stage.parameters():        # to evaluate and sample the whole model
                dist.broadcast(p.data, src=owner)
        val_loss, val_accuracy = evaluate(model, val_loader, device, bf16)
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
    result["stages"] = [None] * world_size  # training only: evaluate() runs the whole model
    dist.all_gather_object(result["stages"], {"stage": rank, "busy_s": clock["busy"], "idle_s":
                                              sum(result["epoch_seconds"]) - clock["busy"]})
    log(f"sample after training:  {result['sample_after']!r}")
    log(f"throughput {result['samples_per_s']:,.0f} samples/s"
        f"{' (first epoch excluded as warm-up)' if epochs > 1 else ''}; "
        f"parameters sha256 {result['params_sha256'][:16]}...")
    log("\n".join(f"stage {s['stage']}: busy {s['busy_s']:.2f} s, idle {s['idle_s']:.2f} s"
                   for s in result["stages"]))
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
    parser.add_argument("--micro-batches", type=positive_int, default=4, help="pieces per batch")
    parser.add_argument("--checkpoint", type=Path, help="save the trained weights here")
    parser.add_argument("--result", type=Path, help="write the result as JSON to this path")
    parser.add_argument("--local-rank", "--local_rank", type=int)  # torch.distributed.launch's
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        stages, blocks = int(os.environ.get("WORLD_SIZE", 1)), SIZES[args.size]["n_layer"]
        if blocks % stages or args.batch_size % args.micro_batches or args.micro_batches < stages:
            raise ValueError(f"{stages} stage(s) must split {blocks} blocks evenly, and "
                             f"{args.micro_batches} micro-batches (one per stage or more) must "
                             f"divide the batch of {args.batch_size}")
        rank, world_size, device = setup(args.backend)
    except ValueError as err:
        print(f"{Path(__file__).name}: error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    log = print if rank == 0 else (lambda *args, **kwargs: None)  # progress from rank 0 only
    model, result = fit(device, size=args.size, epochs=args.epochs, batch_size=args.batch_size,
                        lr=args.lr, seed=args.seed, train_windows=args.train_windows,
                        bf16=args.bf16, micro_batches=args.micro_batches, log=log)
    if args.checkpoint is not None and rank == 0:  # the copies are equal: one writer is enough
        save_checkpoint(model, args.checkpoint)
        print(f"checkpoint saved to {args.checkpoint}")
    dist.barrier()  # no rank goes on (or reads the checkpoint) before it is complete
    gc.collect()  # the schedule's reference cycles hold the group: free them first
    dist.destroy_process_group()
    if args.result is not None and rank == 0:
        args.result.parent.mkdir(parents=True, exist_ok=True)
        args.result.write_text(json.dumps(result, indent=2) + "\n")
        print(f"result written to {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
