# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lesson 10 walkthrough: attention over a sequence no rank holds whole
#
# Six steps, all on a CPU: merge two halves of an attention exactly from their log-sum-exps;
# play a ring of pretend ranks in one process, each holding a quarter of the sequence; count
# the work each rank does under a causal mask with contiguous blocks and with the zig-zag split;
# run the lesson's ring, forward and backward, on 4 real ranks under `torchrun`; train the
# running example with every sequence split over 2 ranks; and measure what a rank keeps.

# %%
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

# Works from the repository root (as a script) and from this folder (as a notebook).
HERE = (Path("lessons/10_long_sequences") if Path("lessons/10_long_sequences").is_dir()
        else Path("."))
torch.manual_seed(0)


def partial_attention(q, k, v, q_positions, k_positions):
    """(out, lse) of the queries over some keys, causal by global position: plain torch."""
    scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(k_positions[None, :] > q_positions[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse[..., None]).nan_to_num()  # a row that sees nothing: 0
    return weights @ v, lse


# %% [markdown]
# ## 1. Two halves of the keys, merged exactly
#
# Attention over keys `a ∪ b` from attention over `a` and over `b` alone: weigh each half's
# output by its share of the softmax's denominator, `exp(lse_half - lse)`.

# %%
q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64) for _ in range(3))
everything = torch.arange(6)
out_a, lse_a = partial_attention(q, k[:, :, :3], v[:, :, :3], everything, everything[:3])
out_b, lse_b = partial_attention(q, k[:, :, 3:], v[:, :, 3:], everything, everything[3:])
lse = torch.logaddexp(lse_a, lse_b)
out = (torch.exp(lse_a - lse)[..., None] * out_a.nan_to_num()
       + torch.exp(lse_b - lse)[..., None] * out_b)
whole = F.scaled_dot_product_attention(q, k, v, is_causal=True)
print("largest difference from attention over all 6 keys:", (out - whole).abs().max().item())
print("lse of the second half on queries 0-2:", lse_b[0, 0, :3].tolist(),
      "(queries 0-2 see no key of the second half)")

# %% [markdown]
# ## 2. A ring of four pretend ranks
#
# Each rank holds 4 of the 16 tokens. At every step each rank attends its queries to the block
# it holds, merges, and hands the block (with its positions) to the next rank.

# %%
world, length = 4, 16
q, k, v = (torch.randn(1, 2, length, 8, dtype=torch.float64) for _ in range(3))
positions = list(torch.arange(length).chunk(world))
held = [(k[:, :, p], v[:, :, p], p) for p in positions]  # rank r holds block r
results = [None] * world
for _step in range(world):  # W blocks: its own, then W - 1 passes
    for rank in range(world):
        k_block, v_block, k_positions = held[rank]
        if k_positions.min() > positions[rank].max():
            continue  # every key after every query of this rank: skipped
        part = partial_attention(q[:, :, positions[rank]], k_block, v_block, positions[rank],
                                 k_positions)
        if results[rank] is None:
            results[rank] = part
        else:
            (o1, l1), (o2, l2) = results[rank], part
            merged = torch.logaddexp(l1, l2)
            results[rank] = (torch.exp(l1 - merged)[..., None] * o1
                             + torch.exp(l2 - merged)[..., None] * o2, merged)
    held = [held[(rank - 1) % world] for rank in range(world)]  # one pass around the ring
ring = torch.cat([out for out, _ in results], dim=2)
whole = F.scaled_dot_product_attention(q, k, v, is_causal=True)
print("ring of 4 against one process, largest difference:", (ring - whole).abs().max().item())

# %% [markdown]
# ## 3. Who does the work under a causal mask
#
# Count the (query, key) pairs each rank's queries see, with contiguous blocks and with the
# zig-zag split (chunks r and 2W-1-r of 2W).


# %%
def pairs(rank_positions):
    return sum(int(p) + 1 for p in rank_positions)  # the query at p sees keys 0..p


chunks = torch.arange(length).chunk(2 * world)
zigzag = [torch.cat([chunks[r], chunks[2 * world - 1 - r]]) for r in range(world)]
print("contiguous:", [pairs(p) for p in positions])
print("zig-zag:   ", [pairs(p) for p in zigzag])

# %% [markdown]
# Contiguous blocks give the last rank almost 6 times the first rank's pairs (2W - 1 = 7 as the
# blocks grow), and every step of the ring waits for it; zig-zag gives each rank the same.
#
# ## 4. The lesson's script on 4 ranks, forward and backward
#
# A notebook kernel is one process: start the ranks with `torchrun` in a subprocess (lesson 03
# explains why). The backward sends the blocks around the ring a second time, with their
# gradients.

# %%
def torchrun(script: str, processes: int, *args: str) -> None:
    """`torchrun --standalone --nproc-per-node=<processes> <script> <args>`; prints its output."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={processes}", str(HERE / script), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    print(done.stdout)
    assert done.returncode == 0, done.stderr


torchrun("ring_attention.py", 4, "--length", "32")

# %% [markdown]
# Every version equals one process to about 1e-15 in float64. The counts are the scores each
# rank computed: contiguous blocks are lopsided, zig-zag with whole blocks is balanced but
# computes every block, and trimming each block to what its queries can see halves the other
# ranks' blocks. The exercises build each piece: the sequence-parallel collectives, the merge,
# one ring step, the zig-zag split and the ring.

# %% [markdown]
# ## 5. The running example, its sequences split over 2 ranks
#
# `train_cp.py` is lesson 03's `train_ddp.py` with a mesh of dp rows × cp columns: each rank
# of a row keeps its zig-zag share of every window, and every block's attention runs the ring
# over the row. Here one row of 2 (`--cp 2`): both ranks read the same 16 windows a step, each
# keeps 16 of their 32 positions.

# %%
torchrun("train_cp.py", 2, "--cp", "2", "--epochs", "1", "--train-windows", "64")

# %% [markdown]
# The sample before training is lesson 03's: sampling runs whole sequences in one process, and
# the model starts from the same seed. The lesson's test runs 4 ranks as dp 2 × cp 2 and checks
# the losses and every trained parameter against one process on whole sequences.
#
# ## 6. What a rank keeps for the backward, by method
#
# `memory_by_length.py` runs one block forward on one sequence four ways on each rank and counts
# what autograd keeps (each tensor once), the parameters and the bytes sent, beside the counts
# the README derives. Context parallelism keeps (17C + H + 4)/W elements per token, the least,
# but every rank holds every parameter; at W = 2 it sends about as much as tensor parallelism.

# %%
torchrun("memory_by_length.py", 2, "--lengths", "64,128")

# %% [markdown]
# Doubling the sequence doubles every line: attention keeps one log-sum-exp per row, never the
# S × S scores. On 4 ranks (`--nproc-per-node=4 ... --plot memory.svg`, the README's figure) only
# context parallelism's line falls by W again.
