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
# # Lesson 06 walkthrough: one layer split across ranks, and the gradient autograd misses
#
# Four steps, all on a CPU: split a linear layer two ways with plain tensors (two pretend
# ranks in one process) and put the results back together; see why the input's gradient needs
# an all-reduce that autograd alone would never do; count what tensor parallelism sends; then
# train the running example with it under `torchrun`, started from here as a subprocess.

# %%
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

# Works from the repository root (as a script) and from this folder (as a notebook).
HERE = (Path("lessons/06_tensor_parallel") if Path("lessons/06_tensor_parallel").is_dir()
        else Path("."))
sys.path.insert(0, str(HERE.parent))  # lessons/, where gpt/ lives
from gpt import GPT, SIZES, CharDataset, GPTConfig  # noqa: E402

torch.manual_seed(0)

# %% [markdown]
# ## 1. Column parallel and row parallel, with two pretend ranks
#
# `nn.Linear` keeps its weight as (out, in). Column parallel gives each rank some **rows**:
# some output features. Row parallel gives each rank some **columns**: some input features, and
# each rank's product is then a partial sum.

# %%
world = 2
x = torch.randn(3, 8)  # 3 tokens, 8 features: the same on every rank
up = torch.nn.Linear(8, 12)  # split by rows (output features)
down = torch.nn.Linear(12, 6)  # split by columns (input features)
whole = down(F.gelu(up(x)))

partial_sums = []
for rank in range(world):
    rows = slice(rank * 6, (rank + 1) * 6)  # this rank's 6 of the 12 hidden features
    hidden = F.gelu(F.linear(x, up.weight[rows], up.bias[rows]))  # no communication
    partial_sums.append(F.linear(hidden, down.weight[:, rows]))  # a partial sum, no bias yet
split = sum(partial_sums) + down.bias  # the all-reduce, then the bias, once
print("largest difference from the unsplit MLP:", (split - whole).abs().max().item())
torch.testing.assert_close(split, whole)

# %% [markdown]
# GELU works on each hidden feature alone, so each rank applies it to its own 6: nothing moves
# between the two layers. One sum (an all-reduce across real ranks) ends the block. Adding the
# bias on every rank before the sum would have added it twice:

# %%
wrong = sum(p + down.bias for p in partial_sums)
print("bias added on both ranks, off by:", (wrong - whole).abs().max().item(),
      "= the largest bias:", down.bias.abs().max().item())

# %% [markdown]
# ## 2. The gradient of the input: each rank sees only its part
#
# Every rank used the same `x`. The gradient of `x` is the sum of what each rank's slice sends
# back, but each rank's autograd only knows its own slice. Compute both:

# %%
x_whole = x.clone().requires_grad_(True)
down(F.gelu(up(x_whole))).sum().backward()

per_rank = []
for rank in range(world):
    rows = slice(rank * 6, (rank + 1) * 6)
    x_mine = x.clone().requires_grad_(True)  # this rank's copy of x
    hidden = F.gelu(F.linear(x_mine, up.weight[rows], up.bias[rows]))
    # The forward's all-reduce passes the gradient through unchanged (g's backward): each rank
    # starts its backward from the same gradient of the output.
    F.linear(hidden, down.weight[:, rows]).sum().backward()
    per_rank.append(x_mine.grad)

print("rank 0 alone is off by:    ", (per_rank[0] - x_whole.grad).abs().max().item())
print("the sum over ranks is off by:", (sum(per_rank) - x_whole.grad).abs().max().item())

# %% [markdown]
# That sum is the all-reduce that *f*, the operator at the entrance to the split layers, does in
# its backward. Without it each rank would train the layers below on part of their gradient.
# Task 6_1 writes *f* and *g* as `torch.autograd.Function`s, so that autograd does both sums
# itself.

# %% [markdown]
# ## 3. What tensor parallelism sends, against data parallelism
#
# Per block and per step: 2 all-reduces in the forward and 2 in the backward, each of one
# activation of the residual stream (batch x tokens x features). Data parallelism all-reduces
# the gradients once: every parameter.

# %%
dataset = CharDataset(SIZES["tiny"]["block_size"])
config = GPTConfig.named("tiny", vocab_size=dataset.vocab_size)
psi = GPT(config).num_parameters()
batch, tokens, features, blocks = 16, config.block_size, config.n_embd, config.n_layer
activation = batch * tokens * features * 4  # bytes, fp32
print(f"tensor parallel: {4 * blocks} all-reduces of {activation / 1e3:.1f} kB = "
      f"{4 * blocks * activation / 1e3:,.1f} kB per step, each on the critical path")
print(f"data parallel:   the gradients, {psi * 4 / 1e3:,.1f} kB per step, overlapped with "
      f"backward")

# %% [markdown]
# For this tiny model TP sends more than DDP would; for a large one (12,288 features) it sends
# far less. Either way every one of its all-reduces sits between two layers, which is why a TP
# group stays on one node's fast links.

# %% [markdown]
# ## 4. The running example, split across 2 ranks, launched from here
#
# A notebook kernel is one process: start the ranks with `torchrun` in a subprocess (lesson 03
# explains why). Rank 0 prints; both ranks read the same batches.

# %%
command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", str(HERE / "train_tp.py"), "--epochs", "1",
           "--train-windows", "64"]
run = subprocess.run(command, capture_output=True, text=True, timeout=180,
                     env={**os.environ, "OMP_NUM_THREADS": "1"})
print(run.stdout)
assert run.returncode == 0, run.stderr

# %% [markdown]
# Each rank stores 123 kB of parameters: half of what the blocks split, and all of the
# embeddings, the head and the layer norms. The losses are those of one process on the same
# batches of 16: tensor parallelism computes one model on one batch, split. The lesson's text
# shows how this script differs from lesson 05's, and the exercises build the split by hand,
# then with `parallelize_module`, then in two dimensions with FSDP2.
