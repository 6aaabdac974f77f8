"""A dry run of a big job on one CPU: the running example sharded with FSDP2 over 128 ranks (or
any number), in one process, with torch's fake process group.

    python lessons/08_measure_and_choose/dry_run.py --world 128 --size gpu

Before asking a cluster for 128 GPUs, check what each of them would hold and send. The "fake"
backend accepts any rank and world size in one process, and its collectives complete at once,
without any other rank, using this rank's tensors alone (an all-reduce leaves its tensor as it
is; an all-gather fills its output with copies of this rank's input): the numbers
a fake step computes mean nothing, while its shapes, and the collectives that made them, are
the real job's. So one process plays each rank in turn:

1. it builds the model on the meta device (shapes without memory), shards it as rank r of W
   would, and reads the shapes of rank r's shards: every rank, with no memory allocated;
2. it gives rank 0's shards real memory (``to_empty``) and runs one training step (forward,
   backward, AdamW), recording every collective as torch dispatches it;
3. it checks those collectives against ``fsdp_step_collectives`` (task8_6's answer, copied below
   so that the script runs without the solutions), and rank 0's bytes of parameters, gradients
   and optimizer state against lesson 05's ZeRO-3 formula, 16 bytes per parameter over W ranks.

Pass ``--width``/``--blocks``/``--context`` to try a bigger model, ``--bf16`` for FSDP2's usual
mixed precision (bf16 parameters, fp32 gradient reduction), ``--keep-after-forward`` for
``reshard_after_forward=False``. Every rank's shapes take about 0.15 s a rank on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore  # the fake group's store
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, for the gpt package
from gpt import GPT, GPTConfig  # noqa: E402
from gpt.run import SIZES, positive_int, refuse  # noqa: E402

SCRIPT = Path(__file__).name
VOCAB = 65  # the running example's characters (lessons/gpt/text.txt)
MB = 1e6

# c10d's operators as torch dispatches them -> (the collective, the argument holding the payload)
DISPATCHED = {"_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
              "allgather_into_tensor_coalesced_": ("all_gather", 0),
              "_reduce_scatter_base_": ("reduce_scatter", 1),
              "reduce_scatter_": ("reduce_scatter", 1),
              "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
              "allreduce_": ("all_reduce", 0), "broadcast_": ("broadcast", 0)}


def nbytes(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(nbytes(t) for t in tensors)


class CollectivesAtDispatch(TorchDispatchMode):
    """Records ``(op, payload bytes)`` for every process-group collective torch dispatches while
    it is open, whichever backend runs it (fake, gloo, NCCL) and whoever calls it (FSDP2 from
    Python, DDP from C++). The payload is the whole tensor: an all-gather's output, a
    reduce-scatter's input. Another c10d operator is recorded under its own name, with 0 bytes;
    DTensor's functional collectives (``_c10d_functional``) are not recorded."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, name = str(getattr(func, "_overloadpacket", func)).partition(".")
        if namespace == "c10d" and name in DISPATCHED:
            op, position = DISPATCHED[name]
            self.calls.append((op, nbytes(args[position])))
        elif namespace == "c10d" and name not in ("wait", "barrier", "monitored_barrier_"):
            self.calls.append((name, 0))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def fake_world(rank: int, world: int):
    """This process as rank ``rank`` of ``world``, in torch's fake process group, for the
    ``with`` block; a device mesh over all of it is yielded."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


def shard(model: torch.nn.Module, mesh, reshard_after_forward: bool = True, bf16: bool = False):
    """Lesson 05's sharding: each block a unit, then the whole (the root, with its default)."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if bf16 else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def groups(model: torch.nn.Module) -> tuple[list[tuple[int, ...]], list[list[tuple[int, ...]]]]:
    """The parameter shapes of the root (what no block holds) and of each block, unsharded."""
    units = [[tuple(p.shape) for p in block.parameters()] for block in model.blocks]
    inside = {id(p) for block in model.blocks for p in block.parameters()}
    return [tuple(p.shape) for p in model.parameters() if id(p) not in inside], units


# --8<-- [start:fsdp_step_collectives]
def fsdp_step_collectives(root: list[tuple[int, ...]], units: list[list[tuple[int, ...]]],
                          world_size: int, param_bytes: int = 4, reduce_bytes: int | None = None,
                          reshard_after_forward: bool = True) -> list[tuple[str, int]]:
    """task8_6: the collectives of one FSDP2 step, one ``(op, payload bytes)`` each (see
    lessons/08_measure_and_choose/exercises.py for the whole contract)."""
    reduce_bytes = param_bytes if reduce_bytes is None else reduce_bytes
    if world_size < 2:
        raise ValueError(f"world_size {world_size}: FSDP needs 2 or more ranks to shard over")
    if min(param_bytes, reduce_bytes) < 1:
        raise ValueError(f"bytes per element must be 1 or more, not {param_bytes}, {reduce_bytes}")
    for shape in [*root, *(shape for unit in units for shape in unit)]:
        if len(shape) == 0 or min(shape) < 1:
            raise ValueError(f"shape {tuple(shape)}: every parameter needs dimensions of 1 or more")

    def padded_numel(shape: tuple[int, ...]) -> int:
        rows = -(-shape[0] // world_size) * world_size
        return rows * math.prod(shape[1:])

    collectives = []
    for shapes, is_root in [(root, True), *((unit, False) for unit in units)]:
        if not shapes:
            continue
        numel = sum(padded_numel(shape) for shape in shapes)
        gathers = 2 if reshard_after_forward and not is_root else 1
        collectives += [("all_gather", numel * param_bytes)] * gathers
        collectives.append(("reduce_scatter", numel * reduce_bytes))
    return collectives
# --8<-- [end:fsdp_step_collectives]


def shapes_of_every_rank(base: torch.nn.Module, world: int, ranks, **how) -> dict[int, dict]:
    """{rank: {parameter name: the shape of that rank's shard}}, each rank sharded on meta."""
    shapes = {}
    for rank in ranks:
        with fake_world(rank, world) as mesh:
            model = shard(copy.deepcopy(base), mesh, **how)
            shapes[rank] = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    return shapes


def one_step(base: torch.nn.Module, config: GPTConfig, world: int, batch_size: int, **how):
    """Rank 0's shards given memory, one step of AdamW: (collectives, bytes rank 0 stores)."""
    with fake_world(0, world) as mesh:
        model = shard(copy.deepcopy(base), mesh, **how)
        model.to_empty(device="cpu")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, config.vocab_size, (batch_size, config.block_size + 1))
        with CollectivesAtDispatch() as sent:
            _, loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            optimizer.step()
        local = [p.to_local() for p in model.parameters()]
        stored = sum(t.nbytes for t in local)
        stored += sum(p.grad.to_local().nbytes for p in model.parameters())
        stored += sum(v.to_local().nbytes for s in optimizer.state.values() for v in s.values()
                      if v.dim())
    return sent.calls, stored


def ranks_where(values: dict[int, object], value) -> str:
    """'ranks 0-64', 'rank 3', 'ranks 0-2, 5': the ranks whose value is ``value``, run by run."""
    chosen = sorted(rank for rank, v in values.items() if v == value)
    runs, start = [], chosen[0]
    for i, rank in enumerate(chosen):
        if i + 1 == len(chosen) or chosen[i + 1] != rank + 1:
            runs.append(f"{start}-{rank}" if rank > start else f"{rank}")
            start = chosen[i + 1] if i + 1 < len(chosen) else None
    return ("rank " if len(chosen) == 1 else "ranks ") + ", ".join(runs)


def n_ranks(values: dict[int, object], value) -> int:
    return sum(v == value for v in values.values())


def rows(n: int) -> str:
    return "none of it" if n == 0 else f"{n} row" if n == 1 else f"{n} rows"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=positive_int, default=128, help="ranks to plan for")
    parser.add_argument("--size", default="gpu", choices=sorted(SIZES))
    parser.add_argument("--width", type=positive_int, help="n_embd, instead of the size's")
    parser.add_argument("--blocks", type=positive_int, help="n_layer, instead of the size's")
    parser.add_argument("--context", type=positive_int, help="block_size, instead of the size's")
    parser.add_argument("--batch-size", type=positive_int, default=1, help="sequences per rank")
    parser.add_argument("--ranks", type=positive_int,
                        help="build only the first and last N // 2 ranks (default: every rank)")
    parser.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 reduction")
    parser.add_argument("--keep-after-forward", action="store_true",
                        help="reshard_after_forward=False for the blocks")
    args = parser.parse_args(argv)
    if args.world < 2:
        parser.error(f"--world {args.world}: FSDP shards over 2 or more ranks")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if dist.is_initialized() or "RANK" in os.environ:
        return refuse(SCRIPT, "it plays every rank itself in one process: run it with python, "
                              "not torchrun")
    overrides = {k: v for k, v in (("n_embd", args.width), ("n_layer", args.blocks),
                                   ("block_size", args.context)) if v is not None}
    config = GPTConfig.named(args.size, vocab_size=VOCAB, **overrides)
    with torch.device("meta"):
        base = GPT(config)
    how = dict(reshard_after_forward=not args.keep_after_forward, bf16=args.bf16)
    root, units = groups(base)
    total = sum(p.numel() for p in base.parameters())
    print(f"{SCRIPT}: GPT {config.n_layer} blocks x {config.n_embd}, {total:,} parameters, "
          f"FSDP2 over {args.world} ranks, played one by one in this process (fake process group)")

    ranks = range(args.world) if not args.ranks or args.ranks >= args.world else sorted(
        {*range(args.ranks // 2 or 1), *range(args.world - args.ranks // 2, args.world)})
    shapes = shapes_of_every_rank(base, args.world, ranks, **how)
    held = {rank: sum(math.prod(shape) for shape in of_rank.values())
            for rank, of_rank in shapes.items()}
    print(f"shards, built on the meta device for {len(shapes)} ranks:")
    for count in sorted(set(held.values()), reverse=True):
        print(f"  {ranks_where(held, count)}: {count:,} parameters each")
    for name, p in base.named_parameters():
        if p.shape[0] % args.world:
            have = {r: shapes[r][name][0] for r in shapes}
            print(f"  {name} {tuple(p.shape)}: " + ", ".join(
                f"{ranks_where(have, n)} {'holds' if n_ranks(have, n) == 1 else 'hold'} {rows(n)}"
                for n in sorted(set(have.values()), reverse=True))
                + f"; it travels as {rows(-(-p.shape[0] // args.world) * args.world)}")

    calls, stored = one_step(base, config, args.world, args.batch_size, **how)
    predicted = fsdp_step_collectives(root, units, args.world, param_bytes=2 if args.bf16 else 4,
                                      reduce_bytes=4, reshard_after_forward=how[
                                          "reshard_after_forward"])
    print("one training step on rank 0, each collective as torch dispatched it:")
    share = (args.world - 1) / args.world
    for op in dict.fromkeys(op for op, _ in calls):
        payloads = [b for o, b in calls if o == op]
        print(f"  {op:<15} {len(payloads):>3} calls, payload {sum(payloads) / MB:9.2f} MB, "
              f"each rank sends {share * sum(payloads) / MB:9.2f} MB (ring)")
    same = Counter(calls) == Counter(predicted)
    print(f"  fsdp_step_collectives predicts {len(predicted)} collectives, "
          f"{sum(b for _, b in predicted) / MB:.2f} MB: "
          + ("the same ones" if same else f"NOT these ({Counter(predicted) - Counter(calls)} "
                                          f"predicted, not run)"))
    ddp = 2 * share * 4 * total
    print(f"  DDP would send {ddp / MB:.2f} MB a step (one all-reduce of the fp32 gradients) "
          f"and keep every byte of the state on every rank")
    print(f"memory on rank 0: {stored / MB:.3f} MB of parameters, gradients and AdamW's two "
          f"moments, 16 bytes for each of its {held[0]:,} parameters; lesson 05's ZeRO-3 "
          f"formula, 16 bytes x ceil(P / W) = {16 * math.ceil(total / args.world) / MB:.3f} MB, "
          f"leaves out the padding")
    return 0 if same and stored == 16 * held[0] else 1


if __name__ == "__main__":
    sys.exit(main())
