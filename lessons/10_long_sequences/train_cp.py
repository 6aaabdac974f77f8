"""Lesson 03's train_ddp.py with context parallelism: every sequence split across processes.

    torchrun --standalone --nproc-per-node=2 lessons/10_long_sequences/train_cp.py           # cp 2
    torchrun --standalone --nproc-per-node=4 lessons/10_long_sequences/train_cp.py --cp 2  # 2-D

The processes form a mesh of dp rows x cp columns. The --cp processes of a row read the same
batch and each keeps its zig-zag share of every sequence's positions; attention runs across
them as a ring (ring_attention.py's, backward by hand). The dp rows read different batches,
and DDP averages every gradient over all the processes. --batch-size is per row.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, default_collate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
# gpt: the running example (model, data); gpt.run: the plumbing every step shares
from gpt import GPT, SIZES, GPTConfig, run  # noqa: E402
from ring_attention import RingAttention, zigzag_split  # noqa: E402 - this lesson's ring


def keep(positions: torch.Tensor):
    """A collate_fn: the batch's windows, inputs and targets, at ``positions`` only."""
    def collate(samples):
        inputs, targets = default_collate(samples)
        return inputs[:, positions], targets[:, positions]
    return collate


def make_loaders(train_set, val_set, batch_size: int, seed: int, device: torch.device, mesh,
                 positions: torch.Tensor):
    # Pinned (page-locked) host memory is what lets a host-to-GPU copy run asynchronously.
    pin = device.type == "cuda"
    # Each dp row takes its 1/dp of the indices; the cp ranks of a row take the same ones, and
    # each keeps its own positions of them.
    dp = mesh.get_group("dp")  # by name: slicing, mesh["dp"], would import dynamo (2 s)
    sampler = DistributedSampler(train_set, num_replicas=dist.get_world_size(dp),
                                 rank=dist.get_rank(dp), shuffle=True, seed=seed)
    train_loader = DataLoader(train_set, batch_size, sampler=sampler, pin_memory=pin,
                              collate_fn=keep(positions))
    val_loader = DataLoader(val_set, batch_size=batch_size, shuffle=False, pin_memory=pin,
                            collate_fn=keep(positions))
    return train_loader, val_loader


@contextlib.contextmanager
def ring_in_blocks(model, positions: torch.Tensor, group):
    """Inside, every block attends across ``group``'s ranks, each holding ``positions`` of every
    sequence; outside (sampling whole sequences), in one process as before."""
    def attend(q, k, v, dropout_p=0.0):
        assert dropout_p == 0, "this ring has no attention dropout"
        return RingAttention.apply(q, k, v, positions, group)
    for block in model.blocks:
        block.attn.attend = attend
    try:
        yield
    finally:
        for block in model.blocks:
            del block.attn.attend  # the class's own: causal_attention


def check_cp(cp: int, world_size: int, size: str, by_default: bool = False) -> None:
    """The mesh is dp x cp, and zig-zag cuts every sequence into 2 x cp equal chunks."""
    length = SIZES[size]["block_size"]
    if world_size % cp or length % (2 * cp):
        fits = max(d for d in range(1, world_size + 1) if not (world_size % d or length % (2 * d)))
        flag = f"--cp {cp}" + (" (the default: every process)" if by_default else "")
        raise ValueError(f"{flag}: cp must divide the processes ({world_size}) and 2 x cp the "
                         f"{size} model's {length} positions; try --cp {fits}")


def train_one_epoch(model, loader, optimizer, device, positions) -> float:
    """One pass over ``loader``; returns the mean training loss per sample."""
    model.train()
    # Summed where the loss is (a tensor from the first step on): a .item() per step would
    # make the CPU wait for the GPU every step.
    loss_sum, seen = 0.0, 0
    for inputs, targets in loader:
        # non_blocking: with pinned memory the copy overlaps with work already queued on the GPU.
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        _, loss = run.next_char_loss(model, inputs, targets, positions=positions)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # k and v's gradients go home round the ring; DDP averages over all
        optimizer.step()
        loss_sum += loss.detach() * targets.shape[0]
        seen += targets.shape[0]
    totals = torch.stack([loss_sum, torch.tensor(float(seen), device=device)])
    dist.all_reduce(totals)  # every rank's share of the epoch
    return (totals[0] / totals[1]).item()


def fit(device: torch.device, size: str = "tiny", epochs: int = 3, batch_size: int = 16,
        lr: float = 3e-3, seed: int = 0, train_windows: int | None = None,
        compile: bool = False, cp: int = 1,
        sample_length: int = 60, log=print):
    """Train from scratch on ``device``; returns (model, result dict)."""
    dataset, train_set, val_set = run.windows(size, train_windows)
    world_size = dist.get_world_size()
    check_cp(cp, world_size, size)
    mesh = run.device_mesh(device.type, (world_size // cp, cp), ("dp", "cp"))
    positions = zigzag_split(torch.arange(dataset.block_size), cp, 0)[mesh.get_local_rank("cp")]
    train_loader, val_loader = make_loaders(train_set, val_set, batch_size, seed, device, mesh,
                                            positions)

    # Built on the CPU from its own seeded generator, then moved: the same start on any device.
    model = GPT(GPTConfig.named(size, vocab_size=dataset.vocab_size), seed=seed).to(device)
    # Created after the move, so the optimizer's state is allocated on the device as well.
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    # The compiled module shares its parameters with `model`; we keep `model` for saving.
    step_model = torch.compile(ddp_model) if compile else ddp_model
    positions = positions.to(device)

    where = (f"world size {world_size} = dp {world_size // cp} x cp {cp}, backend "
             f"{dist.get_backend()}, global batch {world_size // cp} x {batch_size}")
    result = run.begin_result(log, device, where, model, dataset, train_set, val_set, sample_length,
                              size=size, seed=seed, epochs=epochs, batch_size=batch_size,
                              lr=lr, compile=compile, cp=cp, dp=world_size // cp)
    for epoch in range(1, epochs + 1):
        with run.timed(device) as timer, ring_in_blocks(model, positions, mesh.get_group("cp")):
            train_loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on all ranks
            train_loss = train_one_epoch(step_model, train_loader, optimizer, device, positions)
        with ring_in_blocks(model, positions, mesh.get_group("cp")):
            scores = run.evaluate(step_model, val_loader, device, None, positions)
        scores = torch.tensor(scores, device=device)
        dist.all_reduce(scores, group=mesh.get_group("cp"))  # the row's ranks: equal shares
        val_loss, val_accuracy = (scores / cp).tolist()
        run.record_epoch(result, log, train_loss, val_loss, val_accuracy, timer.seconds)
    return model, run.finish_result(result, log, model, dataset, device)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=run.positive_int,
                        help="context-parallel degree (default: every process)")
    return run.add_common_arguments(parser, launched=True).parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        processes = int(os.environ.get("WORLD_SIZE", 1))  # checked before any process group
        cp = args.cp or processes
        check_cp(cp, processes, args.size, by_default=args.cp is None)
        rank, world_size, device = run.setup(args.backend, __file__)
    except ValueError as err:
        return run.refuse(__file__, err)
    torch.set_num_threads(args.threads)
    log = run.rank_zero_log(rank)  # progress from rank 0 only
    model, result = fit(device, size=args.size, epochs=args.epochs, batch_size=args.batch_size,
                        lr=args.lr, seed=args.seed, train_windows=args.train_windows,
                        compile=args.compile, cp=cp,
                        sample_length=args.sample_length, log=log)
    return run.end_run(args, result, model.state_dict(), rank)


if __name__ == "__main__":
    sys.exit(main())
