"""Lesson 03's train_ddp.py with a mixture of experts in every block, the experts split across
the processes (expert parallel x data parallel).

    torchrun --standalone --nproc-per-node=2 lessons/11_mixture_of_experts/train_ep.py  # ep 2
    torchrun --standalone --nproc-per-node=4 lessons/11_mixture_of_experts/train_ep.py --ep 2

Every block's MLP becomes --experts experts behind a router (moe.py's MoE). The processes form
a mesh of dp rows x ep columns: a row holds every expert once, each process a block of them.
Every process reads its own batch; each token travels to its experts' processes and back.
No DDP: what every process holds is averaged over all of them, an expert over its copies in
the other rows (sync_gradients). --batch-size is per process.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
# gpt: the running example (model, data); gpt.run: the plumbing every step shares
from gpt import GPT, GPTConfig, run  # noqa: E402

# moe: this lesson's layer, its process groups and its parameters' names
from moe import ExpertParallelMLP, MoE, expert_groups, split_parameters, whole_state  # noqa: E402


def moe_gpt(config: GPTConfig, seed: int, experts: int, k: int, capacity_factor, group) -> GPT:
    """The running example with a mixture of experts as every block's MLP, of which this process
    keeps its block (in ``group``); each layer from its own seed, the same on every process."""
    model = GPT(config, seed=seed)
    for i, block in enumerate(model.blocks):
        layer = MoE(config.n_embd, experts, k, capacity_factor, seed=seed + 1 + i)
        block.mlp = ExpertParallelMLP(layer, group)
    return model


def sync_gradients(replicated, experts, copies=None, group=None) -> None:
    """The gradients of the mean of every rank's loss (task11_5): the replicated parameters'
    mean over ``group``, the experts' sum over ``copies`` divided by W, the ranks of ``group``."""
    world = dist.get_world_size(group)
    for parameter in replicated:
        dist.all_reduce(parameter.grad, group=group)
        parameter.grad.div_(world)
    for parameter in experts:
        if copies is not None:
            dist.all_reduce(parameter.grad, group=copies)
        parameter.grad.div_(world)


def check_ep(args, ep: int, world_size: int) -> None:
    """The mesh is dp x ep, and each of a row's ep processes holds experts / ep experts."""
    if not 1 <= args.k <= args.experts:
        raise ValueError(f"--k {args.k}: a token chooses 1 to --experts ({args.experts}) experts")
    if args.capacity_factor < 0:
        raise ValueError(f"--capacity-factor {args.capacity_factor:g}: 0 (no limit) or more")
    if world_size % ep or args.experts % ep:
        flag = f"--ep {ep}" + (" (the default: every process)" if args.ep is None else "")
        raise ValueError(f"{flag}: ep must divide the processes ({world_size}) and --experts "
                         f"({args.experts})")


def make_loaders(train_set, val_set, batch_size: int, seed: int, device: torch.device):
    # Pinned (page-locked) host memory is what lets a host-to-GPU copy run asynchronously.
    pin = device.type == "cuda"
    # Each rank takes its 1/world of the indices, shuffled from `seed` and the epoch alike.
    sampler = DistributedSampler(train_set, shuffle=True, seed=seed)
    train_loader = DataLoader(train_set, batch_size, sampler=sampler, pin_memory=pin)
    val_loader = DataLoader(val_set, batch_size=batch_size, shuffle=False, pin_memory=pin)
    return train_loader, val_loader


def train_one_epoch(model, loader, optimizer, device, amp, aux_weight: float, sync) -> float:
    """One pass over ``loader``; returns the mean training loss per sample."""
    model.train()
    # Summed where the loss is (a tensor from the first step on): a .item() per step would
    # make the CPU wait for the GPU every step.
    loss_sum, seen = 0.0, 0
    for inputs, targets in loader:
        # non_blocking: with pinned memory the copy overlaps with work already queued on the GPU.
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        _, loss = run.next_char_loss(model, inputs, targets, amp)
        aux = sum(block.mlp.aux for block in model.blocks)  # every layer's balance, as Switch's
        optimizer.zero_grad(set_to_none=True)
        (loss + aux_weight * aux).backward()  # the tokens' gradients come home by all-to-all
        sync()  # then which ranks average which gradient
        optimizer.step()
        loss_sum += loss.detach() * targets.shape[0]
        seen += targets.shape[0]
    totals = torch.stack([loss_sum, torch.tensor(float(seen), device=device)])
    dist.all_reduce(totals)  # every rank's share of the epoch
    return (totals[0] / totals[1]).item()


def fit(device: torch.device, size: str = "tiny", epochs: int = 3, batch_size: int = 16,
        lr: float = 3e-3, seed: int = 0, train_windows: int | None = None, bf16: bool = False,
        compile: bool = False, ep: int = 1, experts: int = 4, k: int = 2,
        capacity_factor: float | None = 1.25, aux_weight: float = 0.01,
        sample_length: int = 60, log=print):
    """Train from scratch on ``device``; returns (every expert's state dict, result dict)."""
    dataset, train_set, val_set = run.windows(size, train_windows)
    train_loader, val_loader = make_loaders(train_set, val_set, batch_size, seed, device)

    world_size = dist.get_world_size()
    row, column = expert_groups(world_size, ep)  # dp rows x ep columns
    # Built on the CPU from its own seeded generator, then moved: the same start on any device.
    config = GPTConfig.named(size, vocab_size=dataset.vocab_size)
    model = moe_gpt(config, seed, experts, k, capacity_factor, row).to(device)
    # Created after the move, so the optimizer's state is allocated on the device as well.
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    held, own = split_parameters(model)
    copies = column if world_size > ep else None  # the copies of my experts
    sync = functools.partial(sync_gradients, held, own, copies)
    # The compiled module shares its parameters with `model`; we keep `model` for saving.
    step_model = torch.compile(model) if compile else model
    amp = torch.bfloat16 if bf16 else None

    where = (f"world size {world_size} = dp {world_size // ep} x ep {ep}, {experts // ep} of "
             f"{experts} experts each, backend {dist.get_backend()}, global batch {world_size} x "
             f"{batch_size}")
    result = run.begin_result(log, device, where, model, dataset, train_set, val_set, sample_length,
                              size=size, seed=seed, epochs=epochs, batch_size=batch_size,
                              lr=lr, bf16=bf16, compile=compile, dp=world_size // ep, ep=ep,
                              experts=experts, k=k, capacity_factor=capacity_factor,
                              aux_weight=aux_weight)
    for epoch in range(1, epochs + 1):
        with run.timed(device) as timer:  # the device's queued work included
            train_loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on all ranks
            train_loss = train_one_epoch(step_model, train_loader, optimizer, device, amp,
                                         aux_weight, sync)
        val_loss, val_accuracy = run.evaluate(step_model, val_loader, device, amp)
        run.record_epoch(result, log, train_loss, val_loss, val_accuracy, timer.seconds)
    whole = whole_state(model, row)  # every expert, numbered as in one process
    return whole, run.finish_result(result, log, model, dataset, device, weights=whole)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    parser.add_argument("--ep", type=run.positive_int,
                        help="expert-parallel degree (default: every process)")
    parser.add_argument("--experts", type=run.positive_int, default=4, help="experts per block")
    parser.add_argument("--k", type=run.positive_int, default=2, help="experts per token")
    parser.add_argument("--capacity-factor", type=float, default=1.25,
                        help="an expert takes this times its even share (0: no limit)")
    parser.add_argument("--aux-weight", type=float, default=0.01,
                        help="the load-balancing loss's weight (0: none)")
    return run.add_common_arguments(parser, launched=True).parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        processes = int(os.environ.get("WORLD_SIZE", 1))  # checked before any process group
        ep = args.ep or processes
        check_ep(args, ep, processes)
        rank, world_size, device = run.setup(args.backend, __file__)
    except ValueError as err:
        return run.refuse(__file__, err)
    torch.set_num_threads(args.threads)
    log = run.rank_zero_log(rank)  # progress from rank 0 only
    whole, result = fit(device, size=args.size, epochs=args.epochs, batch_size=args.batch_size,
                        lr=args.lr, seed=args.seed, train_windows=args.train_windows,
                        bf16=args.bf16, compile=args.compile, ep=ep, experts=args.experts,
                        k=args.k, capacity_factor=args.capacity_factor or None,
                        aux_weight=args.aux_weight,
                        sample_length=args.sample_length, log=log)
    return run.end_run(args, result, whole, rank)


if __name__ == "__main__":
    sys.exit(main())
