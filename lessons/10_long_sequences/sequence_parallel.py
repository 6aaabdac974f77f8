"""One block of the running example split by tensor parallelism, without and with sequence
parallelism, checked against the unsplit block and measured.

    torchrun --standalone --nproc-per-node=2 lessons/10_long_sequences/sequence_parallel.py

Both versions give each rank its heads and its share of the MLP's hidden features (lesson 06).
Tensor parallelism alone keeps the whole sequence between the split regions: the layer norms
and the residual stream run on every token on every rank, and *f* and *g* all-reduce. With
sequence parallelism a rank keeps only its tokens there, and *f* and *g* become an all-gather
and a reduce-scatter. The third version is the second done torch's way: DTensor layouts
(``SequenceParallel`` on the layer norms, the residual stream ``Shard(1)``) applied with
``parallelize_module``. Rank 0 prints, for each version, how far its output and every gradient
are from the unsplit block's, the elements autograd keeps for the backward, and the bytes each
rank sends, counted as torch dispatches the collectives.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
from gpt import GPTConfig, run  # noqa: E402 - the plumbing every script shares
from gpt.model import Block  # noqa: E402 - one block of the running example

# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (the old names now warn);
# torch 2.11 and 2.12 have only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
COLUMN = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.up_proj")  # split by output rows
ROW = ("attn.out_proj", "mlp.down_proj")  # split by input columns


class CopyToParallel(torch.autograd.Function):
    """Lesson 06's *f*: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromParallel(torch.autograd.Function):
    """Lesson 06's *g*: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group=None):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class AllGatherSequence(torch.autograd.Function):
    """*f* under sequence parallelism: all-gather the tokens, reduce-scatter the gradient
    (task10_1)."""

    @staticmethod
    def forward(ctx, x, group=None, dim=1):
        ctx.group, ctx.dim = group, dim
        mine = x.movedim(dim, 0).contiguous()
        whole = mine.new_empty((dist.get_world_size(group) * mine.shape[0], *mine.shape[1:]))
        all_gather_single(whole, mine, group=group)
        return whole.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        whole = grad.movedim(ctx.dim, 0).contiguous()
        mine = whole.new_empty((whole.shape[0] // dist.get_world_size(ctx.group),
                                *whole.shape[1:]))
        reduce_scatter_single(mine, whole, group=ctx.group)
        return mine.movedim(0, ctx.dim), None, None


class ReduceScatterSequence(torch.autograd.Function):
    """*g* under sequence parallelism: reduce-scatter the partial sums, all-gather the gradient
    (task10_1)."""

    @staticmethod
    def forward(ctx, x, group=None, dim=1):
        world = dist.get_world_size(group)
        if x.shape[dim] % world:
            raise ValueError(f"the sequence's {x.shape[dim]} tokens (dimension {dim}) do not "
                             f"divide among {world} ranks")
        ctx.group, ctx.dim = group, dim
        whole = x.movedim(dim, 0).contiguous()
        mine = whole.new_empty((whole.shape[0] // world, *whole.shape[1:]))
        reduce_scatter_single(mine, whole, group=group)
        return mine.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        mine = grad.movedim(ctx.dim, 0).contiguous()
        whole = mine.new_empty((dist.get_world_size(ctx.group) * mine.shape[0],
                                *mine.shape[1:]))
        all_gather_single(whole, mine, group=ctx.group)
        return whole.movedim(0, ctx.dim), None, None


def split_block(block: Block, x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """``block``'s forward on this rank, with its heads and its hidden features only (views of
    the whole block's weights, so their gradients land in its .grad). ``x``: the whole
    sequence, or with ``sequence_parallel`` this rank's tokens; the output is the same."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if sequence_parallel:
        enter, leave = AllGatherSequence.apply, ReduceScatterSequence.apply
    else:
        enter, leave = CopyToParallel.apply, ReduceFromParallel.apply

    def column(linear, h):  # this rank's output features: rows of the weight
        n = linear.out_features // world
        rows = slice(rank * n, (rank + 1) * n)
        return F.linear(h, linear.weight[rows], linear.bias[rows])

    def row(linear, h):  # this rank's input features: a partial sum; the bias once, after
        n = linear.in_features // world
        return leave(F.linear(h, linear.weight[:, rank * n:(rank + 1) * n])) + linear.bias

    attn, mlp = block.attn, block.mlp
    h = enter(block.ln_1(x))  # every token, on every rank
    B, T, _ = h.shape
    q, k, v = (column(proj, h).view(B, T, -1, attn.head_dim).transpose(1, 2)
               for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # this rank's heads
    x = x + row(attn.out_proj, y.transpose(1, 2).reshape(B, T, -1))
    h = enter(block.ln_2(x))
    return x + row(mlp.down_proj, F.gelu(column(mlp.up_proj, h)))


def dtensor_plan() -> dict:
    """The same split with torch's layouts. The residual stream is ``Shard(1)``: each rank's
    tokens. ``SequenceParallel`` runs a layer norm on them; ``PrepareModuleInput`` all-gathers
    them into one replicated DTensor as attention and the MLP begin (*f*); the row-parallel
    layers reduce-scatter their partial sums back to ``Shard(1)`` (*g*)."""
    stream, whole = (Shard(1),), (Replicate(),)
    return {"ln_1": SequenceParallel(), "ln_2": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=stream, desired_input_layouts=whole),
            "mlp": PrepareModuleInput(input_layouts=stream, desired_input_layouts=whole),
            **{name: ColwiseParallel() for name in COLUMN},
            **{name: RowwiseParallel(output_layouts=stream[0]) for name in ROW}}


class SentBytes(TorchDispatchMode):
    """The bytes this rank sends, by the ring formulas of lesson 08, for each collective torch
    dispatches: all-gather and reduce-scatter (W - 1) / W of the whole, all-reduce twice that;
    a send, what it sends."""

    def __init__(self, world: int):
        super().__init__()
        self.world, self.bytes, self.calls = world, 0.0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # c10d: the process group's own calls (an all-gather's first argument is its output);
        # _c10d_functional: DTensor's, which return their result (the first is the input)
        name = func.overloadpacket.__name__
        share = (self.world - 1) / self.world
        sent = None
        if func.namespace == "c10d" and name == "_allgather_base_":
            sent = share * args[0].nbytes
        elif func.namespace == "c10d" and name == "_reduce_scatter_base_":
            sent = share * args[1].nbytes
        elif func.namespace == "c10d" and name == "allreduce_":
            sent = 2 * share * sum(t.nbytes for t in args[0])
        elif func.namespace == "_c10d_functional" and name == "all_gather_into_tensor":
            sent = share * self.world * args[0].nbytes
        elif func.namespace == "_c10d_functional" and name == "reduce_scatter_tensor":
            sent = share * args[0].nbytes
        elif func.namespace == "_c10d_functional" and name == "all_reduce":
            sent = 2 * share * args[0].nbytes
        elif func.namespace == "c10d" and name == "send":  # a point-to-point send (the ring)
            sent = sum(t.nbytes for t in args[0])
        if sent is not None:
            self.bytes += sent
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


VERSIONS = ("tensor parallel", "tensor + sequence parallel", "the same with DTensor")


def measure(config: dict, batch_size: int, length: int, version: str, seed: int = 0) -> dict:
    """This rank's split block (one of ``VERSIONS``) against the whole block, forward and
    backward: the largest difference, the elements autograd kept (activations, not weights)
    and the bytes sent."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sequence_parallel = version != VERSIONS[0]
    torch.manual_seed(seed)  # every rank: the same block, the same input
    block = Block(GPTConfig(**config)).double()
    x = torch.randn(batch_size, length, config["n_embd"], dtype=torch.float64)
    c = torch.randn(batch_size, length, config["n_embd"], dtype=torch.float64)
    split = block
    if version == VERSIONS[2]:  # a copy, its weights made DTensors, each rank's slices
        split = parallelize_module(copy.deepcopy(block), init_device_mesh("cpu", (world,)),
                                   dtensor_plan())
    weights = {run.local_part(p).untyped_storage().data_ptr()
               for module in (block, split) for p in module.parameters()}
    kept = []

    def pack(tensor):  # a weight (or a slice of one) is not an activation
        if run.local_part(tensor).untyped_storage().data_ptr() not in weights:
            kept.append(run.local_part(tensor).numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out_whole = block(x)  # one process, the whole block
    out_whole.mul(c).sum().backward()
    whole = {name: p.grad.clone() for name, p in block.named_parameters()}
    whole_kept, kept = sum(kept), []
    block.zero_grad()

    tokens = slice(rank * length // world, (rank + 1) * length // world)
    mine = x[:, tokens] if sequence_parallel else x
    out_whole = out_whole.detach()
    with SentBytes(world) as sent:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = (split(mine) if split is not block
                   else split_block(block, mine, sequence_parallel))
        out.mul(c[:, tokens] if sequence_parallel else c).sum().backward()
    expected = out_whole[:, tokens] if sequence_parallel else out_whole
    errors = [(out.detach() - expected).abs().max()]
    partial = []  # the parameters whose gradient on this rank is only its tokens' share
    for name, p in split.named_parameters():
        grad = p.grad
        if isinstance(grad, DTensor):  # its slices gathered, its partial sums added
            partial += [name] * any(place.is_partial() for place in grad.placements)
            errors.append((grad.full_tensor() - whole[name]).abs().max())
            continue
        layer = name.rsplit(".", 1)[0]
        column = layer in COLUMN  # its weight's rows and its bias are sliced
        sliced = column or (layer in ROW and name.endswith("weight"))  # a row's bias is whole
        if not sliced and not torch.allclose(grad, whole[name]):
            partial.append(name)
        if sequence_parallel and not sliced:
            grad = grad.clone()  # each rank saw its tokens only: the sum is the gradient
            dist.all_reduce(grad)
        if sliced:
            n = p.shape[0 if column else 1] // world
            part = slice(rank * n, (rank + 1) * n)
            grad, want = ((grad[part], whole[name][part]) if column
                          else (grad[:, part], whole[name][:, part]))
        else:
            want = whole[name]
        errors.append((grad - want).abs().max())
    error = torch.stack(errors).max()
    dist.all_reduce(error, op=dist.ReduceOp.MAX)
    return {"max_error": error.item(), "kept_elements": sum(kept), "sent_bytes": sent.bytes,
            "collectives": sent.calls, "whole_kept_elements": whole_kept,
            "partial_sums": partial}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gloo", choices=["gloo"],
                        help="the block runs in float64 on the CPU")
    parser.add_argument("--batch-size", type=run.positive_int, default=2)
    parser.add_argument("--length", type=run.positive_int, default=64,
                        help="tokens in the sequence (it must split among the ranks)")
    parser.add_argument("--width", type=run.positive_int, default=64,
                        help="n_embd: the block's width")
    parser.add_argument("--heads", type=run.positive_int, default=4)
    parser.add_argument("--threads", type=run.positive_int, default=1)
    parser.add_argument("--result", type=Path, help="write the result as JSON to this path")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        rank, world, _ = run.setup(args.backend, __file__)
    except ValueError as err:
        return run.refuse(__file__, err)
    bad = [f"{what} {size}" for what, size in (("--length", args.length),
                                               ("--heads", args.heads)) if size % world]
    if bad:
        dist.destroy_process_group()
        return run.refuse(__file__, f"{' and '.join(bad)} must divide among {world} ranks")
    torch.set_num_threads(args.threads)
    log = run.rank_zero_log(rank)
    config = dict(vocab_size=1, n_embd=args.width, n_head=args.heads, block_size=args.length,
                  bias=True, dropout=0.0)
    B, S, C = args.batch_size, args.length, args.width
    log(f"one block of width {C}, {args.heads} heads, on {B} x {S} tokens (float64), split "
        f"over {world} ranks ({dist.get_backend()})")
    log(f"{'version':<28} {'largest error':>13} {'kept for backward':>18} "
        f"{'bytes sent per rank':>20}")
    result = {"world_size": world, "batch_size": B, "length": S, "width": C, "versions": {}}
    for name in VERSIONS:
        found = measure(config, B, S, name)
        result["versions"][name] = found
        log(f"{name:<28} {found['max_error']:>13.1e} {found['kept_elements']:>18,} "
            f"{found['sent_bytes']:>20,.0f}")
    tp, sp, _ = result["versions"].values()
    log(f"{'one process, the whole block':<28} {'':>13} {tp['whole_kept_elements']:>18,} "
        f"{0:>20}")
    fewer = tp["kept_elements"] - sp["kept_elements"]
    log(f"kept, tensor parallel minus sequence parallel: {fewer:,} = 2 x B x S x (C + 2) x "
        f"(W - 1) / W = "
        f"{2 * B * S * (C + 2) * (world - 1) // world:,}: the layer norms' inputs, means and "
        f"reciprocal deviations, on S / W tokens instead of S")
    if args.result and rank == 0:
        run.write_result(result, args.result, log)
    dist.barrier()  # no rank leaves the group while another still talks to it
    gc.collect()  # the DTensor block's device mesh holds the group: free it first
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
