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

--save-every N saves every N steps as well as at the end, --keep K keeps only the newest K
checkpoints, and --async-save writes them with dcp.async_save while training goes on. Under
torchrun --nnodes=MIN:MAX, --lose-node-at-step N makes node 1 fail after step N as a machine
does (its torchrun and its processes killed at once): the other nodes go on without it.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import signal
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
from gpt import GPT, CharDataset, GPTConfig, parameter_digest, run  # noqa: E402

LR = 3e-3


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


def save(path: Path, model, optimizer, step: int, group=None):
    """Every rank writes its shards; .metadata comes last (DCP writes it, then renames). With
    ``group``, dcp.async_save: it returns once this rank's state is copied to memory of its own,
    and a thread writes it, its collectives on ``group`` (gloo), apart from training's. Returns
    the future of that write, or None once a synchronous save is whole."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": step}
    if group is None:
        dcp.save(state, checkpoint_id=path)
        return None
    return dcp.async_save(state, checkpoint_id=path, process_group=group)


def load(path: Path, model, optimizer) -> int:
    """Fill this rank's shards from the checkpoint, whoever wrote it; returns its step."""
    model_state, optimizer_state = get_state_dict(model, optimizer)  # the shapes to fill
    state = {"model": model_state, "optimizer": optimizer_state, "step": -1}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    return state["step"]


def checkpoints(folder: Path) -> list[Path]:
    """The whole step-<N>/ folders, oldest first: whole once .metadata is there (written last)."""
    found = [path for path in folder.glob("step-*") if path.name[5:].isdigit()
             and (path / ".metadata").is_file()]
    return sorted(found, key=lambda path: int(path.name[5:]))


def newest_checkpoint(folder: Path) -> Path | None:
    """The newest whole step-<N>/, or None."""
    found = checkpoints(folder)
    return found[-1] if found else None


class Checkpoints:
    """step-<N>/ folders in ``folder``: one save written at a time, the newest ``keep`` kept
    (0: all; the disk holds one more while a new one is written), written by dcp.async_save
    when ``asynchronous``."""

    def __init__(self, folder: Path, keep: int = 0, asynchronous: bool = False):
        self.folder, self.keep = folder, keep
        self.group = dist.new_group(backend="gloo", timeout=run.TIMEOUT) if asynchronous else None
        self.writing = None  # the future of the save being written

    def save(self, model, optimizer, step: int) -> None:
        # The one before must be whole: each async_save writes from a thread of its own, and
        # two at once would interleave their collectives on the group (and hold two copies).
        self.wait()
        self.writing = save(self.folder / f"step-{step:08d}", model, optimizer, step, self.group)
        if self.writing is None:
            self.prune()

    def wait(self) -> None:
        """Until the save being written is whole (and the old ones are pruned)."""
        if self.writing is not None:
            self.writing.result()
            self.writing = None
            self.prune()

    def prune(self) -> None:
        """Rank 0 removes all but the newest ``keep`` whole checkpoints, once a new one is
        whole: the .metadata of this rank's save is written after every rank's shards."""
        if self.keep and dist.get_rank() == 0:
            for old in checkpoints(self.folder)[:-self.keep]:
                shutil.rmtree(old)


AGENT = os.getppid()  # the torchrun that started this process, noted before any of them dies


def lose_this_node() -> None:
    """What a machine that fails does to its processes: its torchrun agent and this process
    are killed at once, with no chance to say goodbye (each of the node's ranks does both)."""
    try:
        os.kill(AGENT, signal.SIGKILL)
    except ProcessLookupError:  # another rank of this node was first
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def full_state(model) -> dict[str, torch.Tensor]:
    """The whole model, gathered from every rank's shards, on rank 0's CPU."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-dir", type=Path,
                        help="default: a temporary folder, removed at the end")
    parser.add_argument("--steps", type=run.positive_int, default=6,
                        help="train up to this step, then save")
    parser.add_argument("--global-batch", type=run.positive_int, default=8)
    parser.add_argument("--save-every", type=run.positive_int, help="also every N steps")
    parser.add_argument("--keep", type=run.positive_int, help="only the newest K checkpoints")
    parser.add_argument("--async-save", action="store_true", help="dcp.async_save, not dcp.save")
    parser.add_argument("--lose-node-at-step", type=run.positive_int,
                        help="node 1 (GROUP_RANK 1) fails after this step")
    parser.add_argument("--compare", action="store_true",
                        help="rank 0 also trains every step in one unsharded process")
    parser.add_argument("--result", type=Path, help="write the run's result here (JSON)")
    args = parser.parse_args(argv)
    if args.lose_node_at_step and "GROUP_RANK" not in os.environ:  # its parent is no agent
        return run.refuse(__file__, "--lose-node-at-step needs torchrun's nodes: torchrun "
                                    "--nnodes=1:2 --rdzv-backend=c10d ... in two terminals")
    if args.lose_node_at_step and os.environ.get("GROUP_WORLD_SIZE") == "1":
        print(f"{Path(__file__).name}: one node: no node 1 to lose", file=sys.stderr)
    torch.set_num_threads(1)
    try:
        rank, world, _ = run.setup("gloo", __file__)  # CPU: this is about files, not speed
    except ValueError as err:
        return run.refuse(__file__, err)
    temporary = args.checkpoint_dir is None
    if temporary:  # rank 0 makes the folder; every rank needs its name
        name = [tempfile.mkdtemp(prefix="sharded-checkpoint-") if rank == 0 else None]
        dist.broadcast_object_list(name, src=0)
        args.checkpoint_dir = Path(name[0])
    dataset = CharDataset(32)
    config = GPTConfig.named("tiny", vocab_size=dataset.vocab_size)
    model, optimizer = build(config)
    start, resume = 0, newest_checkpoint(args.checkpoint_dir)
    if resume is not None:
        start = load(resume, model, optimizer)
        if rank == 0:
            writers = len(list(resume.glob("*.distcp")))
            print(f"resumed from {resume}: step {start}, written by {writers} ranks, "
                  f"read by {world}")
    saves = Checkpoints(args.checkpoint_dir, args.keep or 0, args.async_save)
    for step in range(start + 1, args.steps + 1):
        try:
            train(model, optimizer, dataset, step - 1, step, args.global_batch)
        except ValueError as err:
            return run.refuse(__file__, err)
        if step == args.steps or args.save_every and step % args.save_every == 0:
            saves.save(model, optimizer, step)
        if step == args.lose_node_at_step and os.environ.get("GROUP_RANK") == "1":
            saves.wait()
            print(f"node 1, rank {rank}: lost after step {step}", flush=True)
            lose_this_node()
    saves.wait()
    whole = full_state(model)  # a collective: every rank takes part
    if rank == 0:
        kept = [path.name for path in checkpoints(args.checkpoint_dir)]
        files = sorted(p.name for p in (args.checkpoint_dir / kept[-1]).iterdir())
        print(f"{world} ranks trained steps {start} to {args.steps}; saved {kept[-1]}: {files}")
        if len(kept) > 1 or args.keep:
            print(f"checkpoints kept: {kept}")
        digest = parameter_digest(whole)
        print(f"parameters sha256 {digest[:16]}...")
        if args.compare:
            alone, alone_optimizer = build(config, shard=False)
            train(alone, alone_optimizer, dataset, 0, args.steps, args.global_batch, False)
            gap = max((whole[k] - v).abs().max().item() for k, v in alone.state_dict().items())
            print(f"largest difference from one process that trained steps 0 to "
                  f"{args.steps}: {gap:.1e}")
        if args.result:
            run.write_result({"world_size": world, "start": start, "steps": args.steps,
                              "resumed_from": resume and resume.name, "kept": kept,
                              "parameters_sha256": digest}, args.result)
    dist.barrier()
    if temporary and rank == 0:
        shutil.rmtree(args.checkpoint_dir)
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
