"""Checkpoint an FSDP2 model with torch.distributed.checkpoint; resume on another number of ranks.

    torchrun --standalone --nproc-per-node=4 \\
        lessons/09_survive_and_scale_out/sharded_checkpoint.py --checkpoint-dir /tmp/dcp --steps 3
    torchrun --standalone --nproc-per-node=2 \\
        lessons/09_survive_and_scale_out/sharded_checkpoint.py --checkpoint-dir /tmp/dcp --steps 6

Every rank holds 1/W of the parameters and of AdamW's state (lesson 05), so every rank writes
its own part: step-<N>/__<rank>_0.distcp, and the coordinator (rank 0) writes .metadata last,
which says where each piece of each tensor is. A run that finds a checkpoint loads it whatever
the number of ranks that wrote it: each rank reads the pieces its own shards need. The global
batch is the same at any world size (--global-batch sequences, split evenly between the ranks),
so the run goes on as if nothing had changed; --compare trains the same steps in one unsharded
process on rank 0 and prints how far apart the two are.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
from gpt import GPT, CharDataset, GPTConfig, parameter_digest  # noqa: E402

LR = 3e-3


def join_group() -> None:
    """Join torchrun's group on gloo (CPU: the lesson is about files, not speed); without a
    launcher, a group of one on a store at port 0."""
    timeout = datetime.timedelta(seconds=60)  # a missing peer becomes an error, not a hang
    if "RANK" in os.environ:
        dist.init_process_group("gloo", timeout=timeout)
    else:
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timeout)


def build(config: GPTConfig, shard: bool = True):
    """The running example, each block and the root sharded over every rank; AdamW after."""
    model = GPT(config, seed=0)
    if shard:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def global_batch(dataset: CharDataset, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s sequences, the same at any world size: windows step*size onwards."""
    windows = [dataset[(step * size + i) % len(dataset)] for i in range(size)]
    return torch.stack([w[0] for w in windows]), torch.stack([w[1] for w in windows])


def train(model, optimizer, dataset, start: int, stop: int, size: int, share: bool = True):
    """Steps ``start`` to ``stop``: each rank its equal slice of the global batch."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if share else (0, 1)
    if size % world:
        raise ValueError(f"--global-batch {size} does not split evenly between {world} ranks")
    for step in range(start, stop):
        inputs, targets = global_batch(dataset, step, size)
        part = slice(rank * size // world, (rank + 1) * size // world)
        logits, _ = model(inputs[part])
        loss = F.cross_entropy(logits.flatten(0, 1), targets[part].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # FSDP reduce-scatters the mean over the ranks: the global batch's mean
        optimizer.step()


def save(path: Path, model, optimizer, step: int) -> None:
    """Every rank writes its shards; .metadata comes last (DCP writes it, then renames)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state, "step": step},
             checkpoint_id=path)


def load(path: Path, model, optimizer) -> int:
    """Fill this rank's shards from the checkpoint, whoever wrote it; returns its step."""
    model_state, optimizer_state = get_state_dict(model, optimizer)  # the shapes to fill
    state = {"model": model_state, "optimizer": optimizer_state, "step": -1}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    return state["step"]


def newest_checkpoint(folder: Path) -> Path | None:
    """The newest step-<N>/ whose .metadata is there: DCP writes it after every shard."""
    found = [path for path in folder.glob("step-*") if path.name[5:].isdigit()
             and (path / ".metadata").is_file()]
    return max(found, key=lambda path: int(path.name[5:]), default=None)


def full_state(model) -> dict[str, torch.Tensor]:
    """The whole model, gathered from every rank's shards, on rank 0's CPU."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-dir", type=Path,
                        help="default: a temporary folder, removed at the end")
    parser.add_argument("--steps", type=int, default=6, help="train up to this step, then save")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--compare", action="store_true",
                        help="rank 0 also trains every step in one unsharded process")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    join_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    temporary = args.checkpoint_dir is None
    if temporary:  # rank 0 makes the folder; every rank needs its name
        name = [tempfile.mkdtemp(prefix="sharded-checkpoint-") if rank == 0 else None]
        dist.broadcast_object_list(name, src=0)
        args.checkpoint_dir = Path(name[0])
    dataset = CharDataset(32)
    config = GPTConfig.named("tiny", vocab_size=dataset.vocab_size)
    model, optimizer = build(config)
    start = 0
    resume = newest_checkpoint(args.checkpoint_dir)
    if resume is not None:
        start = load(resume, model, optimizer)
        if rank == 0:
            writers = len(list(resume.glob("*.distcp")))
            print(f"resumed from {resume}: step {start}, written by {writers} ranks, "
                  f"read by {world}")
    try:
        train(model, optimizer, dataset, start, args.steps, args.global_batch)
    except ValueError as err:
        print(f"{Path(__file__).name}: error: {err}", file=sys.stderr)
        return 2
    path = args.checkpoint_dir / f"step-{args.steps:08d}"
    save(path, model, optimizer, args.steps)
    whole = full_state(model)  # a collective: every rank takes part
    if rank == 0:
        files = sorted(p.name for p in path.iterdir())
        print(f"{world} ranks trained steps {start} to {args.steps}; saved {path}: {files}")
        print(f"parameters sha256 {parameter_digest(whole)[:16]}...")
        if args.compare:
            alone, alone_optimizer = build(config, shard=False)
            train(alone, alone_optimizer, dataset, 0, args.steps, args.global_batch, False)
            gap = max((whole[k] - v).abs().max().item() for k, v in alone.state_dict().items())
            print(f"largest difference from one process that trained steps 0 to "
                  f"{args.steps}: {gap:.1e}")
    dist.barrier()
    if temporary and rank == 0:
        shutil.rmtree(args.checkpoint_dir)
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
