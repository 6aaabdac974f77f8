"""Ring attention across ranks, forward and backward, checked against attention in one process.

    torchrun --standalone --nproc-per-node=4 lessons/10_long_sequences/ring_attention.py

Every rank builds the same whole sequence from a seed, keeps its share of the tokens and runs
causal attention over the whole sequence with a ring: the key/value blocks travel around it in
the forward, and again, with their gradients, in the backward (written by hand, the way
FlashAttention's backward is). It does so three ways: contiguous blocks; zig-zag with a block
skipped only when no query of the rank sees any of its keys; and zig-zag with each block
trimmed to the keys some query sees and the queries that see some key (what PyTorch's context
parallel does for its head-tail split). Rank 0 prints how far each is from one process, and
how many scores each rank computed.

    torchrun --standalone --nproc-per-node=2 lessons/10_long_sequences/ring_attention.py --torch-cp

--torch-cp adds a fourth row: torch's own context_parallel around SDPA's memory-efficient CUDA
kernel, in float32, forward and backward. It needs a GPU per process (nccl); two processes on one
GPU cannot share it under NCCL, so a real split needs two GPUs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
from gpt import run  # noqa: E402 - the plumbing every script shares: setup, logging, results

LAYOUTS = {"contiguous": False, "zigzag": False, "zigzag, trimmed": True}  # layout: trim?
NEEDS_CUDA = ("--torch-cp needs CUDA GPUs, one per process (nccl): torch's context_parallel "
              "attends across ranks only inside SDPA's flash, memory-efficient and cuDNN CUDA "
              "kernels, and its dispatch table has none of SDPA's CPU kernels; without "
              "--torch-cp this script runs the lesson's own ring anywhere")


def merge_partials(out_a, lse_a, out_b, lse_b):
    """The attention over two disjoint key sets, from each one's (out, lse) (task10_2)."""
    top = torch.maximum(lse_a, lse_b)  # finite: one side at least saw a key
    lse = top + torch.log(torch.exp(lse_a - top) + torch.exp(lse_b - top))
    out = (torch.exp(lse_a - lse).unsqueeze(-1) * out_a
           + torch.exp(lse_b - lse).unsqueeze(-1) * out_b)
    return out, lse


def attend_block(q, k, v, q_positions, k_positions, causal=True, scale=None):
    """(out, lse) of the queries over one block of keys, masked by global positions (task10_3)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        visible = k_positions[None, :] <= q_positions[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True).detach()  # -inf on a row that sees nothing
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(scores - top)  # 0 where masked
    total = weights.sum(dim=-1, keepdim=True)
    seen = total > 0
    out = (weights @ v) / torch.where(seen, total, torch.ones_like(total))
    lse = torch.where(seen, top + torch.log(torch.where(seen, total, torch.ones_like(total))),
                      torch.full_like(total, float("-inf")))
    return out, lse.squeeze(-1)


def zigzag_split(x, world_size, dim):
    """Rank r's piece: chunks r and 2W-1-r of 2W (task10_4)."""
    chunks = 2 * world_size
    if x.shape[dim] % chunks:
        raise ValueError(f"a sequence of {x.shape[dim]} tokens does not cut into {chunks} "
                         f"equal chunks (2 per rank for {world_size} ranks)")
    pieces = x.chunk(chunks, dim=dim)
    return [torch.cat([pieces[r], pieces[chunks - 1 - r]], dim=dim) for r in range(world_size)]


def ring_pass(tensors, group=None):
    """Send each tensor to the next rank, receive the previous rank's: one batch of isend/irecv."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return list(tensors)
    group = group or dist.group.WORLD
    to = dist.get_global_rank(group, (rank + 1) % world)
    source = dist.get_global_rank(group, (rank - 1) % world)
    # contiguous: a transposed tensor's strides would make a receive buffer torch refuses
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = []
    for tensor, into in zip(tensors, received, strict=True):
        ops.append(dist.P2POp(dist.isend, tensor.contiguous(), to, group))
        ops.append(dist.P2POp(dist.irecv, into, source, group))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


def needed(q_positions, k_positions, causal: bool, trim: bool):
    """Which queries and which keys of a block take part: all of them (none when no query sees
    any key), or, trimmed, the keys some query sees and the queries that see some key."""
    rows = torch.ones_like(q_positions, dtype=torch.bool)
    cols = torch.ones_like(k_positions, dtype=torch.bool)
    if causal and trim:
        rows, cols = q_positions >= k_positions.min(), k_positions <= q_positions.max()
    elif causal and k_positions.min() > q_positions.max():
        cols = ~cols
    return rows, cols


class RingAttention(torch.autograd.Function):
    """``RingAttention.apply(q, k, v, positions, group, causal, trim)``: this rank's out, with a
    backward that sends the blocks around the ring once more, their gradients travelling with
    them. ``RingAttention.scores`` counts the scores each call computed (forward and backward)."""

    scores = 0

    @staticmethod
    def forward(ctx, q, k, v, positions, group=None, causal=True, trim=True):
        out, lse = attend_block(q, k, v, positions, positions, causal)  # sees itself
        RingAttention.scores = q.shape[-2] * k.shape[-2]
        block = [k, v, positions]
        for _ in range(dist.get_world_size(group) - 1):
            block = ring_pass(block, group)
            k_block, v_block, k_positions = block
            rows, cols = needed(positions, k_positions, causal, trim)
            if not cols.any():
                continue  # every key comes after every query: nothing to compute
            part = attend_block(q[:, :, rows], k_block[:, :, cols], v_block[:, :, cols],
                                positions[rows], k_positions[cols], causal)
            out[:, :, rows], lse[:, :, rows] = merge_partials(out[:, :, rows], lse[:, :, rows],
                                                              *part)
            RingAttention.scores += int(rows.sum()) * int(cols.sum())
        ctx.save_for_backward(q, k, v, positions, out, lse)  # this rank's tokens only
        ctx.group, ctx.causal, ctx.trim = group, causal, trim
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, positions, out, lse = ctx.saved_tensors
        scale = q.shape[-1] ** -0.5
        # softmax's backward: dS = P * (dP - rowsum(dO * O)), one number per query row
        delta = (grad_out * out).sum(dim=-1, keepdim=True)
        grad_q = torch.zeros_like(q)
        block = [k, v, positions, torch.zeros_like(k), torch.zeros_like(v)]
        for step in range(dist.get_world_size(ctx.group)):
            if step:  # the block moves on with the gradients its keys and values have so far
                block = ring_pass(block, ctx.group)
            k_block, v_block, k_positions, grad_k, grad_v = block
            rows, cols = needed(positions, k_positions, ctx.causal, ctx.trim)
            if not cols.any():
                continue
            q_rows, k_cols, v_cols = q[:, :, rows], k_block[:, :, cols], v_block[:, :, cols]
            scores = (q_rows @ k_cols.transpose(-2, -1)) * scale
            if ctx.causal:
                hidden = k_positions[cols][None, :] > positions[rows][:, None]
                scores = scores.masked_fill(hidden, float("-inf"))
            p = torch.exp(scores - lse[:, :, rows, None])  # this block's share of the softmax
            grad_rows = grad_out[:, :, rows]
            grad_v[:, :, cols] += p.transpose(-2, -1) @ grad_rows
            grad_scores = p * (grad_rows @ v_cols.transpose(-2, -1) - delta[:, :, rows])
            grad_q[:, :, rows] += grad_scores @ k_cols * scale
            grad_k[:, :, cols] += grad_scores.transpose(-2, -1) @ q_rows * scale
            RingAttention.scores += int(rows.sum()) * int(cols.sum())
        # After W - 1 passes a rank holds its next rank's block: one more pass takes it home.
        grad_k, grad_v = ring_pass(block[3:], ctx.group)
        return grad_q, grad_k, grad_v, None, None, None, None


def split(layout: str, length: int, world: int, rank: int) -> torch.Tensor:
    positions = torch.arange(length)
    if layout == "contiguous":
        return positions.chunk(world)[rank]
    return zigzag_split(positions, world, 0)[rank]


def check(layout: str, whole: dict, reference: dict, rank: int, world: int, device) -> dict:
    """One layout: this rank's ring attention against the whole sequence's, forward and
    backward; the largest error over every rank, and each rank's scores computed."""
    positions = split(layout, whole["q"].shape[-2], world, rank).to(device)
    mine = {name: t.index_select(2, positions) for name, t in whole.items()}
    q, k, v = (mine[name].clone().requires_grad_(True) for name in "qkv")
    out = RingAttention.apply(q, k, v, positions, None, True, LAYOUTS[layout])
    (out * mine["c"]).sum().backward()
    got = {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
    error = torch.stack([(got[name] - reference[name].index_select(2, positions)).abs().max()
                         for name in ("out", "q", "k", "v")])
    dist.all_reduce(error, op=dist.ReduceOp.MAX)
    scores = [0] * world
    dist.all_gather_object(scores, RingAttention.scores)
    return {"max_error": dict(zip(("out", "grad_q", "grad_k", "grad_v"), error.tolist(),
                                  strict=True)),
            "scores_per_rank": scores}


def torch_context_parallel(whole: dict, world: int, device) -> dict:
    """The same attention with torch's ``context_parallel`` around SDPA's memory-efficient CUDA
    kernel, in float32 (SDPA's CUDA kernels take no float64), against that kernel on the whole
    sequence, forward and backward; the largest error over every rank, and each rank's tokens."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = run.device_mesh("cuda", (world,), ("cp",))  # one dimension, cp; a 2-D mesh: the same
    whole = {name: t.float() for name, t in whole.items()}
    length = whole["q"].shape[2]
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):  # both calls: this kernel or an error
        q, k, v = (whole[name].clone().requires_grad_(True) for name in "qkv")
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        (want * whole["c"]).sum().backward()
        reference = {"out": want.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
        # Sharded in place on entry: from then on each holds this rank's tokens. Restoring them
        # on exit would keep a whole copy of each meanwhile; we do not read them again.
        buffers = [whole[name].clone() for name in "qkvc"] + [torch.arange(length, device=device)]
        # --length divides by 2W (main checks): torch 2.11 asserts it for its head-tail split,
        # which 2.14 falls back from to contiguous blocks otherwise.
        with context_parallel(mesh["cp"], buffers=buffers, buffer_seq_dims=[2, 2, 2, 2, 0],
                              no_restore_buffers=set(buffers)):
            q, k, v = (t.requires_grad_(True) for t in buffers[:3])
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # torch's ring
            (out * buffers[3]).sum().backward()  # inside too: the backward's ring is torch's
        positions = buffers[4]  # where this rank's tokens sit: torch's head-tail split
    got = {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
    error = torch.stack([(got[name] - reference[name].index_select(2, positions)).abs().max()
                         for name in ("out", "q", "k", "v")])
    dist.all_reduce(error, op=dist.ReduceOp.MAX)
    held = [None] * world
    dist.all_gather_object(held, positions.tolist())
    return {"max_error": dict(zip(("out", "grad_q", "grad_k", "grad_v"), error.tolist(),
                                  strict=True)),
            "positions_per_rank": held, "kernel": "memory-efficient"}


def spans(positions: list[int]) -> str:
    """[0, 1, 2, 6, 7] -> "0-2+6-7": runs of consecutive positions."""
    runs = []
    for p in positions:
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return "+".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--batch-size", type=run.positive_int, default=2)
    parser.add_argument("--heads", type=run.positive_int, default=2)
    parser.add_argument("--length", type=run.positive_int, default=64,
                        help="tokens in the whole sequence (it must split into 2 x ranks)")
    parser.add_argument("--head-dim", type=run.positive_int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=run.positive_int, default=1)
    parser.add_argument("--result", type=Path, help="write the result as JSON to this path")
    parser.add_argument("--torch-cp", action="store_true",
                        help="also run torch's context_parallel (CUDA GPUs only)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.torch_cp and (args.backend == "gloo" or not torch.cuda.is_available()):
        return run.refuse(__file__, NEEDS_CUDA)
    try:
        rank, world, device = run.setup(args.backend, __file__)
    except ValueError as err:
        return run.refuse(__file__, err)
    if args.torch_cp and device.type != "cuda":  # auto chose gloo: fewer GPUs than processes
        dist.destroy_process_group()
        return run.refuse(__file__, NEEDS_CUDA)
    if args.length % (2 * world):
        dist.destroy_process_group()
        return run.refuse(__file__, f"--length {args.length} does not split into 2 x {world} "
                                    f"equal chunks (zig-zag); pad the sequence or change it")
    if args.torch_cp and args.length % (64 * world):  # each rank's half-chunk: 32k rows
        dist.destroy_process_group()
        return run.refuse(__file__, f"--torch-cp needs --length a multiple of 64 x {world}: the "
                          "memory-efficient kernel pads its log-sum-exp to a multiple of 32 rows "
                          "and torch's ring merges it as it is")
    torch.set_num_threads(args.threads)
    log = run.rank_zero_log(rank)
    generator = torch.Generator().manual_seed(args.seed)  # every rank: the same sequence
    shape = (args.batch_size, args.heads, args.length, args.head_dim)
    whole = {name: torch.randn(shape, generator=generator, dtype=torch.float64).to(device)
             for name in "qkvc"}  # c: the weights of the loss, sum(out * c)
    q, k, v = (whole[name].clone().requires_grad_(True) for name in "qkv")
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # one process, whole
    (out * whole["c"]).sum().backward()
    reference = {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
    log(f"causal attention over {args.length} tokens ({args.batch_size} x {args.heads} heads "
        f"x head_dim {args.head_dim}, float64) on {world} rank{'s' * (world > 1)}, "
        f"{dist.get_backend()}; "
        f"each rank holds {args.length // world} tokens")
    log(f"{'split':<16} {'largest error':>14}   scores computed per rank (forward + backward)")
    result = {"world_size": world, "length": args.length, "layouts": {}}
    for layout in LAYOUTS:
        found = check(layout, whole, reference, rank, world, device)
        result["layouts"][layout] = found
        log(f"{layout:<16} {max(found['max_error'].values()):>14.1e}   "
            + " ".join(f"{n:>6}" for n in found["scores_per_rank"]))
    if args.torch_cp:
        found = torch_context_parallel(whole, world, device)
        result["torch_context_parallel"] = found
        log(f"torch's context_parallel, SDPA's {found['kernel']} kernel, float32: largest "
            f"error {max(found['max_error'].values()):.1e}; tokens per rank: "
            + ", ".join(spans(held) for held in found["positions_per_rank"]))
    log(f"one process computes 2 x {args.length}^2 = {2 * args.length ** 2} scores (forward and "
        f"backward), {args.length * (args.length + 1)} of them visible under the causal mask")
    if args.result and rank == 0:
        run.write_result(result, args.result, log)
    dist.barrier()  # no rank leaves the group while another still talks to it
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
