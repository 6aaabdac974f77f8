"""Memory per rank against sequence length, for data, tensor, tensor + sequence and context
parallelism: one block of the running example, measured on W ranks and predicted.

    torchrun --standalone --nproc-per-node=4 lessons/10_long_sequences/memory_by_length.py \
        --plot memory.svg

Every rank runs one block of the running example forward on one sequence of S tokens, four
ways: whole (data parallelism: each rank has its own sequences, whole); split by heads and
features with DTensor (tensor parallelism, lesson 06); the same with the residual stream split
along the sequence (sequence parallelism, sequence_parallel.py's plan); and on its zig-zag
share of the tokens with the ring in place of attention (context parallelism, train_cp.py's
block). It counts what autograd keeps for the backward, each tensor once (a tensor saved twice
is stored once), the keys and values among it, and the bytes of its parameters, and rank 0
prints them beside the formulas.
With --plot it draws the measured points and the predicted lines, on to longer sequences.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lessons/, where gpt/ lives
from gpt import GPTConfig, run  # noqa: E402 - the plumbing every script shares
from gpt.model import Block  # noqa: E402 - one block of the running example
from ring_attention import RingAttention, zigzag_split  # noqa: E402 - this lesson's ring
from sequence_parallel import COLUMN, ROW, SentBytes, dtensor_plan  # noqa: E402 - this lesson's

METHODS = ("data parallel", "tensor parallel", "tensor + sequence parallel", "context parallel")
FLOAT = 4  # bytes: the block runs in float32


def tensor_plan() -> dict:
    """Lesson 06's split of a block: heads and hidden features, the stream whole."""
    return {"attn": PrepareModuleInput(input_layouts=(Replicate(),),
                                       desired_input_layouts=(Replicate(),),
                                       use_local_output=False),
            **{name: ColwiseParallel() for name in COLUMN},
            **{name: RowwiseParallel() for name in ROW}}


def predicted(method: str, length: int, width: int, heads: int, world: int) -> dict[str, float]:
    """Bytes a rank keeps for one block's backward on one sequence, and of its parameters.

    Per token, one process keeps: each layer norm's input, mean and reciprocal deviation
    (C + 2, twice) and output (C, twice: the input of q, k and v, and of up_proj); attention's
    q, k, v and output (4C: SDPA's output is out_proj's input too) and one log-sum-exp per head
    (H); GELU's input and output (4C each): 16C + H + 4 elements. Tensor parallelism splits
    what is per head or per hidden feature (12C + H) W ways; sequence parallelism also the
    norms' inputs and statistics (2C + 4); context parallelism splits every token's, keeps its
    tokens' positions (int64), and one C more per token: the ring's output is not out_proj's
    input, which is a copy (the heads put back side by side).
    """
    C, H, S, W = width, heads, length, world
    per_token = {"data parallel": 16 * C + H + 4,
                 "tensor parallel": 4 * C + 4 + (12 * C + H) / W,
                 "tensor + sequence parallel": 2 * C + (14 * C + H + 4) / W,
                 "context parallel": (17 * C + H + 4) / W}[method]
    activations = FLOAT * S * per_token + (8 * S / W if method == "context parallel" else 0)
    # Of those, the keys and values attention keeps: every token's and every head's in one
    # process; a W-th under tensor parallelism (its heads) and context parallelism (its tokens).
    kv = FLOAT * 2 * S * C / (1 if method == "data parallel" else W)
    stream = FLOAT * S * C  # one sequence's residual stream, or its keys (or values)
    sent = {"data parallel": 0,  # nothing per block; the gradients' all-reduce once a step
            # 2 all-reduces each way (lesson 06), at 2 (W - 1) / W of the stream each
            "tensor parallel": 4 * 2 * (W - 1) / W * stream,
            # the same bytes as 4 all-gathers and 4 reduce-scatters
            "tensor + sequence parallel": 4 * 2 * (W - 1) / W * stream,
            # forward: W - 1 passes of a block of keys, values (S / W tokens) and positions;
            # backward: W - 1 passes with the keys' and values' gradients too, then one pass
            # of the gradients home
            "context parallel": (W - 1) * (2 * stream / W + 8 * S / W)
            + (W - 1) * (4 * stream / W + 8 * S / W) + 2 * stream / W}[method]
    whole = 12 * C * C + 13 * C  # four C x C projections, C x 4C and 4C x C, biases, norms
    split = 12 * C * C + 7 * C  # what tensor parallelism slices: all but the row layers'
    # biases (2 C) and the norms (4 C)
    tensor = method.startswith("tensor")
    parameters = FLOAT * ((split / W + whole - split) if tensor else whole)
    return {"activations": activations, "kv": kv, "parameters": parameters, "sent": sent}


def measure_block(method: str, length: int, width: int, heads: int, seed: int = 0) -> dict:
    """This rank's bytes for one block's forward on one sequence of ``length`` tokens: what
    autograd keeps for the backward (each storage once), of which the keys and values (the
    outputs of k_proj and v_proj, which attention keeps), its parameters, and what it sends in
    the forward and the backward."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)  # every rank: the same block, the same sequence
    block = Block(GPTConfig(vocab_size=1, n_embd=width, n_head=heads, block_size=length))
    x = torch.randn(1, length, width)
    if method == "tensor parallel":
        block = parallelize_module(block, init_device_mesh("cpu", (world,)), tensor_plan())
    elif method == "tensor + sequence parallel":
        block = parallelize_module(block, init_device_mesh("cpu", (world,)), dtensor_plan())
        x = x.chunk(world, dim=1)[rank].clone()  # its own storage, as a rank's would be
    elif method == "context parallel":
        positions = zigzag_split(torch.arange(length), world, 0)[rank]
        block.attn.attend = lambda q, k, v, dropout_p: RingAttention.apply(q, k, v, positions)
        x = x[:, positions]
    weights = {run.local_part(p).untyped_storage().data_ptr() for p in block.parameters()}
    kept: dict[int, int] = {}
    keys_values: set[int] = set()  # the storages of k_proj's and v_proj's outputs
    hooks = [layer.register_forward_hook(lambda module, args, out: keys_values.add(
        run.local_part(out).untyped_storage().data_ptr()))
        for layer in (block.attn.k_proj, block.attn.v_proj)]

    def pack(tensor):  # an activation, once per storage; a weight (or a slice of one) is not
        storage = run.local_part(tensor).untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with SentBytes(world) as sent:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = block(x.requires_grad_(True))
        out.sum().backward()  # every rank: the ring's backward is collective
    for hook in hooks:
        hook.remove()
    return {"activations": sum(kept.values()),
            "kv": sum(kept.get(pointer, 0) for pointer in keys_values),
            "parameters": sum(run.local_part(p).nbytes for p in block.parameters()),
            "sent": sent.bytes}


def plot(rows: list[dict], path: Path, width: int, heads: int, world: int) -> None:
    """Measured points and predicted lines, activations on a log-log scale, to 64x longer."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    lengths = sorted({row["length"] for row in rows})
    longer = [lengths[0]]  # doubling, from the shortest measured to 64 x the longest
    while longer[-1] < 64 * lengths[-1]:
        longer.append(2 * longer[-1])
    for method in METHODS:
        line = [predicted(method, s, width, heads, world)["activations"] / 2**20 for s in longer]
        drawn = axes.plot(longer, line, label=f"{method} (predicted)")[0]
        got = [(r["length"], r["activations"] / 2**20) for r in rows if r["method"] == method]
        axes.plot(*zip(*got, strict=True), "o", color=drawn.get_color())
        if method in ("data parallel", "context parallel"):  # TP's and TP + SP's are CP's
            kv = [predicted(method, s, width, heads, world)["kv"] / 2**20 for s in longer]
            axes.plot(longer, kv, "--", color=drawn.get_color(),
                      label=f"{method}: of it, keys and values")
            got = [(r["length"], r["kv"] / 2**20) for r in rows if r["method"] == method]
            axes.plot(*zip(*got, strict=True), "x", color=drawn.get_color())
    axes.set(xscale="log", yscale="log", xlabel="sequence length S (tokens)",
             ylabel="MiB kept for the backward, per rank",
             title=f"one block, width {width}, {heads} heads, float32, W = {world}: "
                   "measured (dots, crosses), predicted (lines)")
    axes.title.set_fontsize(9)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gloo", choices=["gloo"],
                        help="the block runs in float32 on the CPU")
    parser.add_argument("--lengths", default="64,128,256,512",
                        help="sequence lengths, comma-separated (each divides by 2 x ranks)")
    parser.add_argument("--width", type=run.positive_int, default=64, help="n_embd")
    parser.add_argument("--heads", type=run.positive_int, default=4)
    parser.add_argument("--threads", type=run.positive_int, default=1)
    parser.add_argument("--plot", type=Path, help="draw an SVG here (needs matplotlib)")
    parser.add_argument("--result", type=Path, help="write the rows as JSON to this path")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        lengths = [run.positive_int(s) for s in args.lengths.split(",")]
        rank, world, _ = run.setup(args.backend, __file__)
    except (ValueError, argparse.ArgumentTypeError) as err:
        return run.refuse(__file__, err)
    bad = [f"--lengths {s}" for s in lengths if s % (2 * world)]
    bad += [f"--heads {args.heads}"] if args.heads % world else []
    if bad:
        dist.destroy_process_group()
        return run.refuse(__file__, f"{', '.join(bad)}: each length must divide by 2 x "
                                    f"{world} ranks (zig-zag), the heads by {world}")
    torch.set_num_threads(args.threads)
    log = run.rank_zero_log(rank)
    log(f"one block, width {args.width}, {args.heads} heads, one sequence, float32, per rank of "
        f"{world}: kept for the backward (each tensor once) and the keys and values among it, "
        f"parameters, and sent in the forward and backward, in kB; each beside its count")
    log(f"{'method':<27}{'S':>5}{'kept':>9}{'count':>9}{'of it KV':>9}{'count':>7}"
        f"{'params':>8}{'count':>7}{'sent':>8}{'count':>8}")
    rows = []
    for length in lengths:
        for method in METHODS:
            got = measure_block(method, length, args.width, args.heads)
            want = predicted(method, length, args.width, args.heads, world)
            rows.append({"method": method, "length": length, **got,
                         "predicted": want})
            log(f"{method:<27}{length:>5}" + "".join(
                f"{got[key] / 1e3:>{w},.1f}{want[key] / 1e3:>{w2},.1f}"
                for key, w, w2 in (("activations", 9, 9), ("kv", 9, 7), ("parameters", 8, 7),
                                   ("sent", 8, 8))))
    if rank == 0 and args.plot:
        plot(rows, args.plot, args.width, args.heads, world)
        log(f"plot written to {args.plot}")
    if rank == 0 and args.result:
        run.write_result({"world_size": world, "width": args.width, "heads": args.heads,
                          "rows": rows}, args.result, log)
    dist.barrier()  # no rank leaves the group while another still talks to it
    gc.collect()  # the DTensor blocks' device meshes hold the group: free them first
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
