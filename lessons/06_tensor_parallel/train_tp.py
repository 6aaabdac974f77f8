"""Lesson 05's train_fsdp.py with tensor parallelism: every block's layers split across processes.

    torchrun --standalone --nproc-per-node=2 lessons/06_tensor_parallel/train_tp.py           # tp 2
    torchrun --standalone --nproc-per-node=4 lessons/06_tensor_parallel/train_tp.py --tp 2  # 2-D

The processes form a mesh of dp rows x tp columns. The --tp processes of a row each hold a slice
of every weight matrix of the blocks and read the same batch; the dp rows read different batches,
and FSDP2 shards each slice across them. --batch-size is per row: the global batch is dp x batch.
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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, DistributedSampler, Subset

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


LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def setup(backend: str = "auto") -> tuple[int, int, torch.device]:
    """Join the launcher's process group (no launcher: a group of one): rank, world, device."""
    missing = [name for name in LAUNCHER_VARIABLES if name not in os.environ]
    if 0 < len(missing) < len(LAUNCHER_VARIABLES):
        raise ValueError(f"the launcher did not set {missing}; start with: "
                         "torchrun --standalone --nproc-per-node=N train_tp.py")
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


def make_loaders(train_set, val_set, batch_size: int, seed: int, device: torch.device, mesh):
    # Pinned (page-locked) host memory is what lets a host-to-GPU copy run asynchronously.
    pin = device.type == "cuda"
    # Each dp row takes its 1/dp of the indices; the tp ranks of a row take the same ones.
    sampler = DistributedSampler(train_set, num_replicas=mesh["dp"].size(),
                                 rank=mesh["dp"].get_local_rank(), shuffle=True, seed=seed)
    train_loader = DataLoader(train_set, batch_size, sampler=sampler, pin_memory=pin)
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
        loss.backward()  # FSDP reduce-scatters each block's gradients as its backward ends
        optimizer.step()
        loss_sum += loss.detach() * targets.shape[0]
        seen += targets.shape[0]
    totals = torch.stack([loss_sum, torch.tensor(float(seen), device=device)])
    dist.all_reduce(totals)  # every rank's share of the epoch
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


def sample(model, dataset: CharDataset, device, length: int = 20) -> str:
    """``length`` characters after a newline (20: each one pays a split forward's collectives)."""
    start = torch.tensor([dataset.encode("\n")], device=device)
    ids = model.generate(start, length, generator=torch.Generator().manual_seed(0))
    return dataset.decode(ids[0, 1:])


def save_checkpoint(state_dict, path: Path) -> None:
    """Write to a temporary name, then rename: a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save(state_dict, partial)
    os.replace(partial, path)


def state_bytes(model, optimizer, device: torch.device) -> dict[str, int]:
    """Bytes of this process's shards (the DTensors' local parts) of the parameters, gradients
    and optimizer state; on a GPU also the peak allocated, activations and buffers included."""
    for module in (*model.blocks, model):  # free what a forward left gathered (the root, at
        module.reshard()                     # least: backward would begin there)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    moments = [v for state in optimizer.state.values() for v in state.values() if v.dim()]
    sizes = {name: sum(t.to_local().nbytes for t in tensors) for name, tensors in (
        ("parameters", model.parameters()), ("gradients", grads), ("optimizer_state", moments))}
    if device.type == "cuda":
        sizes["peak_allocated"] = torch.cuda.max_memory_allocated(device)
    return sizes


def block_plan() -> dict:
    """Split by heads and hidden features: one all-reduce per forward and per backward each for
    the attention and the MLP. PrepareModuleInput makes the attention's input one replicated
    DTensor, so q, k and v's input gradients are all-reduced together, once."""
    return {"attn": PrepareModuleInput(input_layouts=(Replicate(),),
                                       desired_input_layouts=(Replicate(),),
                                       use_local_output=False),
            **{f"attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")},
            "attn.out_proj": RowwiseParallel(),
            "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}


def check_tp(tp: int, world_size: int, size: str, flag: str = "") -> None:
    """A tp degree must divide the processes (the mesh is dp x tp) and the heads (whole heads)."""
    heads = SIZES[size]["n_head"]
    processes = f"the number of processes ({world_size} process{'es' * (world_size > 1)})"
    wrong = [what for what, n in ((processes, world_size), (f"the {size} model's {heads} heads",
                                                           heads)) if n % tp]
    if wrong:
        fits = [d for d in range(1, world_size + 1) if world_size % d == 0 == heads % d]
        raise ValueError(f"{flag or f'--tp {tp}'} must divide {' and '.join(wrong)}; try "
                         f"--tp {fits[-1]}")


def fit(device: torch.device, size: str = "tiny", epochs: int = 3, batch_size: int = 16,
        lr: float = 3e-3, seed: int = 0, train_windows: int | None = None, bf16: bool = False,
        compile: bool = False, reshard_after_forward: bool = True, tp: int = 1, log=print):
    """Train from scratch on ``device``; returns (model, result dict)."""
    dataset = CharDataset(SIZES[size]["block_size"])
    train_set, val_set = train_val_split(dataset)
    if train_windows:  # a quick run: the first windows only
        train_set = Subset(train_set, range(min(train_windows, len(train_set))))
    world_size = dist.get_world_size()
    check_tp(tp, world_size, size)
    mesh = init_device_mesh(device.type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
    train_loader, val_loader = make_loaders(train_set, val_set, batch_size, seed, device, mesh)

    # Built on the CPU from its own seeded generator, then moved: the same start on any device.
    model = GPT(GPTConfig.named(size, vocab_size=dataset.vocab_size), seed=seed).to(device)
    # Each block split across the tp ranks of a row first (its weights become DTensors), then
    # each slice sharded across the dp rows. The rest (embeddings, norms, head) is not split:
    # FSDP shards it across the rows. With --bf16: gather and compute in bf16, reduce in fp32.
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                  reduce_dtype=torch.float32 if bf16 else None)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], block_plan())
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward,
                    mp_policy=policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    # Created after sharding, so the optimizer's state exists for this rank's shards only.
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    # The compiled module shares its parameters with `model`.
    step_model = torch.compile(model) if compile else model

    where = (f"world size {world_size} = dp {world_size // tp} x tp {tp}, backend "
             f"{dist.get_backend()}, global batch {world_size // tp} x {batch_size}")
    log(f"device {device} ({where}), torch {torch.__version__}, {len(train_set)} train / "
        f"{len(val_set)} val windows of {dataset.block_size} characters, "
        f"{model.num_parameters():,} parameters, seed {seed}")
    result = {"world_size": dist.get_world_size(), "backend": dist.get_backend(),
              "device": str(device), "size": size, "seed": seed, "epochs": epochs,
              "batch_size": batch_size, "lr": lr, "bf16": bf16, "compile": compile,
              "reshard_after_forward": reshard_after_forward, "tp": tp, "dp": world_size // tp,
              "torch": torch.__version__, "sample_before": sample(model, dataset, device),
              "train_loss": [], "val_loss": [], "val_accuracy": [], "epoch_seconds": []}
    log(f"sample before training: {result['sample_before']!r}")
    for epoch in range(1, epochs + 1):
        sync(device)  # start the clock with nothing still queued from before
        start = time.perf_counter()
        train_loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on all ranks
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
    # Every rank's share of the state, then the whole model gathered on rank 0 (on the CPU).
    result["bytes_per_rank"] = [None] * dist.get_world_size()
    dist.all_gather_object(result["bytes_per_rank"], state_bytes(model, optimizer, device))
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    result["params_sha256"] = parameter_digest(whole)
    log(f"sample after training:  {result['sample_after']!r}")
    log(f"throughput {result['samples_per_s']:,.0f} samples/s"
        f"{' (first epoch excluded as warm-up)' if epochs > 1 else ''}; "
        f"parameters sha256 {result['params_sha256'][:16]}...")
    for rank, sizes in enumerate(result["bytes_per_rank"]):
        log(f"rank {rank} stores " + ", ".join(f"{k.replace('_', ' ')} {v / 1e3:,.1f} kB"
                                               for k, v in sizes.items()))
    return whole, result


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
    parser.add_argument("--bf16", action="store_true", help="bfloat16: FSDP's policy, autocast")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--tp", type=positive_int, help="tensor-parallel degree (default: all)")
    parser.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction,
                        default=True, help="free each block's gathered parameters after its "
                        "forward, gather again for backward (default; --no-...: keep them)")
    parser.add_argument("--checkpoint", type=Path, help="save the trained weights here")
    parser.add_argument("--result", type=Path, help="write the result as JSON to this path")
    parser.add_argument("--local-rank", "--local_rank", type=int)  # torch.distributed.launch's
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        tp = args.tp or int(os.environ.get("WORLD_SIZE", 1))
        check_tp(tp, int(os.environ.get("WORLD_SIZE", 1)), args.size,
                 "" if args.tp else f"--tp {tp} (the default: every process)")
        rank, world_size, device = setup(args.backend)
    except ValueError as err:
        print(f"{Path(__file__).name}: error: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    log = print if rank == 0 else (lambda *args, **kwargs: None)  # progress from rank 0 only
    whole, result = fit(device, size=args.size, epochs=args.epochs, batch_size=args.batch_size,
                        lr=args.lr, seed=args.seed, train_windows=args.train_windows,
                        bf16=args.bf16, compile=args.compile,
                        reshard_after_forward=args.reshard_after_forward, tp=tp, log=log)
    if args.checkpoint is not None and rank == 0:  # rank 0 holds the gathered whole model
        save_checkpoint(whole, args.checkpoint)
        print(f"checkpoint saved to {args.checkpoint}")
    dist.barrier()  # no rank goes on (or reads the checkpoint) before it is complete
    gc.collect()  # the model's reference cycles hold the group: free them before destroying it
    dist.destroy_process_group()
    if args.result is not None and rank == 0:
        args.result.parent.mkdir(parents=True, exist_ok=True)
        args.result.write_text(json.dumps(result, indent=2) + "\n")
        print(f"result written to {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
