"""Lesson 05's train_fsdp.py with tensor parallelism: every block's layers split across processes.

    torchrun --standalone --nproc-per-node=2 lessons/06_tensor_parallel/train_tp.py           # tp 2
    torchrun --standalone --nproc-per-node=4 lessons/06_tensor_parallel/train_tp.py --tp 2  # 2-D

The processes form a mesh of dp rows x tp columns. The --tp processes of a row each hold a slice
of every weight matrix of the blocks and read the same batch; the dp rows read different batches,
and FSDP2 shards each slice across them. --batch-size is per row: the global batch is dp x batch.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
# gpt: the running example (model, data); gpt.run: the plumbing every step shares
from gpt import GPT, SIZES, GPTConfig, run  # noqa: E402


def make_loaders(train_set, val_set, batch_size: int, seed: int, device: torch.device, mesh):
    # Pinned (page-locked) host memory is what lets a host-to-GPU copy run asynchronously.
    pin = device.type == "cuda"
    # Each dp row takes its 1/dp of the indices; the tp ranks of a row take the same ones.
    sampler = DistributedSampler(train_set, num_replicas=mesh["dp"].size(),
                                 rank=mesh["dp"].get_local_rank(), shuffle=True, seed=seed)
    train_loader = DataLoader(train_set, batch_size, sampler=sampler, pin_memory=pin)
    val_loader = DataLoader(val_set, batch_size=batch_size, shuffle=False, pin_memory=pin)
    return train_loader, val_loader


def train_one_epoch(model, loader, optimizer, device, amp=None) -> float:
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
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # FSDP reduce-scatters each block's gradients as its backward ends
        optimizer.step()
        loss_sum += loss.detach() * targets.shape[0]
        seen += targets.shape[0]
    totals = torch.stack([loss_sum, torch.tensor(float(seen), device=device)])
    dist.all_reduce(totals)  # every rank's share of the epoch
    return (totals[0] / totals[1]).item()


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


def check_tp(tp: int, world_size: int, size: str, by_default: bool = False) -> None:
    """A tp degree must divide the processes (the mesh is dp x tp) and the heads (whole heads)."""
    heads = SIZES[size]["n_head"]
    wrong = []
    if world_size % tp:
        plural = "process" if world_size == 1 else "processes"
        wrong.append(f"the number of processes ({world_size} {plural})")
    if heads % tp:
        wrong.append(f"the {size} model's {heads} heads")
    if wrong:
        fits = max(d for d in range(1, world_size + 1) if world_size % d == 0 and heads % d == 0)
        flag = f"--tp {tp}" + (" (the default: every process)" if by_default else "")
        raise ValueError(f"{flag} must divide {' and '.join(wrong)}; try --tp {fits}")


def fit(device: torch.device, size: str = "tiny", epochs: int = 3, batch_size: int = 16,
        lr: float = 3e-3, seed: int = 0, train_windows: int | None = None, bf16: bool = False,
        compile: bool = False, reshard_after_forward: bool = True, tp: int = 1,
        sample_length: int = 60, log=print):
    """Train from scratch on ``device``; returns (the whole model's state dict, result dict)."""
    dataset, train_set, val_set = run.windows(size, train_windows)
    world_size = dist.get_world_size()
    check_tp(tp, world_size, size)
    mesh = run.device_mesh(device.type, (world_size // tp, tp), ("dp", "tp"))
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
    amp = torch.bfloat16 if bf16 else None

    where = (f"world size {world_size} = dp {world_size // tp} x tp {tp}, backend "
             f"{dist.get_backend()}, global batch {world_size // tp} x {batch_size}")
    result = run.begin_result(log, device, where, model, dataset, train_set, val_set, sample_length,
                              size=size, seed=seed, epochs=epochs, batch_size=batch_size,
                              lr=lr, bf16=bf16, compile=compile,
                              reshard_after_forward=reshard_after_forward,
                              tp=tp, dp=world_size // tp)
    for epoch in range(1, epochs + 1):
        with run.timed(device) as timer:  # the device's queued work included
            train_loader.sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on all ranks
            train_loss = train_one_epoch(step_model, train_loader, optimizer, device, amp)
        val_loss, val_accuracy = run.evaluate(step_model, val_loader, device, amp)
        run.record_epoch(result, log, train_loss, val_loss, val_accuracy, timer.seconds)
    # Every rank's share of the state, then the whole model gathered on rank 0 (on the CPU).
    for module in (*model.blocks, model):  # free what a forward left gathered (the root, at
        module.reshard()                     # least: backward would begin there)
    result["bytes_per_rank"] = run.bytes_per_rank(model, optimizer, device, log)
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    return whole, run.finish_result(result, log, model, dataset, device, weights=whole)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bf16", action="store_true", help="bfloat16: FSDP's policy, autocast")
    parser.add_argument("--tp", type=run.positive_int, help="tensor-parallel degree (default: all)")
    parser.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction,
                        default=True, help="free each block's gathered parameters after its "
                        "forward, gather again for backward (default; --no-...: keep them)")
    return run.add_common_arguments(parser, launched=True).parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        processes = int(os.environ.get("WORLD_SIZE", 1))  # checked before any process group
        tp = args.tp or processes
        check_tp(tp, processes, args.size, by_default=args.tp is None)
        rank, world_size, device = run.setup(args.backend, __file__)
    except ValueError as err:
        return run.refuse(__file__, err)
    torch.set_num_threads(args.threads)
    log = run.rank_zero_log(rank)  # progress from rank 0 only
    whole, result = fit(device, size=args.size, epochs=args.epochs, batch_size=args.batch_size,
                        lr=args.lr, seed=args.seed, train_windows=args.train_windows,
                        bf16=args.bf16, compile=args.compile,
                        reshard_after_forward=args.reshard_after_forward, tp=tp,
                        sample_length=args.sample_length, log=log)
    return run.end_run(args, result, whole, rank)  # rank 0 holds the gathered whole model


if __name__ == "__main__":
    sys.exit(main())
