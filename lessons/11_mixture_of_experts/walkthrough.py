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
# # Lesson 11 walkthrough: tokens that travel to their experts
#
# Four steps, all on a CPU: route eight tokens among four experts and watch the capacity drop
# some; plan which rows go to which of two pretend ranks; play both all-to-alls of expert
# parallelism in one process and check the result against the layer; then run the lesson's
# script, forward and backward, on 2 real ranks under `torchrun`.

# %%
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn as nn

# Works from the repository root (as a script) and from this folder (as a notebook).
HERE = (Path("lessons/11_mixture_of_experts") if Path("lessons/11_mixture_of_experts").is_dir()
        else Path("."))
torch.manual_seed(0)
tokens, width, num_experts, k = 8, 4, 4, 2

# %% [markdown]
# ## 1. Route: top-2 of a softmax, renormalised, and a capacity
#
# Each expert takes at most `capacity` assignments: every token's first choice is served
# before any second choice.

# %%
router = nn.Linear(width, num_experts, bias=False)
x = torch.randn(tokens, width)
with torch.no_grad():
    top, experts = router(x).softmax(dim=-1).topk(k, dim=-1)
weights = top / top.sum(dim=-1, keepdim=True)
capacity = 4  # the even share is tokens * k / num_experts = 4

taken = [0] * num_experts
kept = torch.zeros(tokens, k, dtype=torch.bool)
for choice in range(k):
    for t in range(tokens):
        e = int(experts[t, choice])
        if taken[e] < capacity:
            taken[e] += 1
            kept[t, choice] = True
print("experts per token:", experts.tolist())
print("kept:             ", kept.int().tolist())
print("assignments per expert:", torch.bincount(experts.flatten(), minlength=num_experts).tolist(),
      "kept:", taken)

# %% [markdown]
# ## 2. The plan: the kept assignments sorted by expert
#
# With experts 0 and 1 on rank 0 and experts 2 and 3 on rank 1, the sorted list is already cut
# by destination: its first part goes to rank 0, the rest to rank 1.

# %%
world = 2
chosen = kept.flatten().nonzero().flatten()
order = chosen[torch.argsort(experts.flatten()[chosen], stable=True)]
per_expert = torch.bincount(experts.flatten()[chosen], minlength=num_experts)
send = per_expert.view(world, -1).sum(dim=1).tolist()
print("flat indices t * k + j, by expert:", order.tolist())
print("rows to rank 0 and rank 1:", send)

# %% [markdown]
# ## 3. Both all-to-alls, played in one process
#
# Two pretend ranks, each with the same layer and its own tokens. An all-to-all hands piece d
# of rank s's rows to rank d: a list of lists is enough to play it.

# %%
experts_mlps = nn.ModuleList(nn.Sequential(nn.Linear(width, 8), nn.GELU(), nn.Linear(8, width))
                             for _ in range(num_experts))
batches = [torch.randn(tokens, width) for _ in range(world)]


def plan(batch):
    with torch.no_grad():
        top, chosen_experts = router(batch).softmax(dim=-1).topk(k, dim=-1)
    w = top / top.sum(dim=-1, keepdim=True)
    flat = chosen_experts.flatten()
    order = torch.argsort(flat, stable=True)  # no capacity here: every assignment kept
    counts = torch.bincount(flat, minlength=num_experts)
    return w, flat, order, counts


plans = [plan(b) for b in batches]
# Dispatch: rank s cuts its sorted rows by destination rank.
outgoing = [batch[order // k].split(counts.view(world, -1).sum(dim=1).tolist())
            for batch, (_, _, order, counts) in zip(batches, plans, strict=True)]
arrived = [[outgoing[s][d] for s in range(world)] for d in range(world)]  # the all-to-all
results = []
mine = num_experts // world
for d in range(world):
    # What arrived from rank s is grouped by expert too: cut it by s's counts of my experts,
    # then run each of my experts once, on its rows from every rank.
    cut = [arrived[d][s].split(plans[s][3][d * mine:(d + 1) * mine].tolist())
           for s in range(world)]
    outputs = [experts_mlps[d * mine + j](torch.cat([cut[s][j] for s in range(world)]))
               for j in range(mine)]
    # Back into the order the rows arrived in (by rank, then expert), for the return trip.
    pieces = [out.split([len(cut[s][j]) for s in range(world)]) for j, out in enumerate(outputs)]
    results.append([torch.cat([pieces[j][s] for j in range(mine)]) for s in range(world)])
back = [torch.cat([results[d][s] for d in range(world)]) for s in range(world)]  # combine
for s, (w, flat, order, _) in enumerate(plans):
    slots = torch.zeros(tokens * k, width)
    slots[order] = back[s].detach()
    out = (slots.view(tokens, k, width) * w[..., None]).sum(dim=1)
    expected = torch.zeros(tokens, width)
    for t in range(tokens):
        for j in range(k):
            expected[t] += w[t, j] * experts_mlps[int(flat[t * k + j])](batches[s][t]).detach()
    print(f"rank {s}: largest difference from the loop over tokens:",
          f"{(out - expected).abs().max().item():.1e}")

# %% [markdown]
# Each rank ran only its own two experts, and every token got its result back in its place.
# The lesson's script does the same with `all_to_all_single`, uneven sizes and a real backward.
#
# ## 4. The lesson's script on 2 ranks, forward and backward
#
# A notebook kernel is one process: start the ranks with `torchrun` in a subprocess (lesson 03
# explains why).

# %%
command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", str(HERE / "moe.py"), "--tokens", "32"]
run = subprocess.run(command, capture_output=True, text=True, timeout=180,
                     env={**os.environ, "OMP_NUM_THREADS": "1"})
print(run.stdout)
assert run.returncode == 0, run.stderr

# %% [markdown]
# The output, the gradients of the input and the router, and each expert's gradient on the
# rank that holds it equal the layer in one process. The exercises build each piece: the
# routing, the plan, the two exchanges and the layer built from them.

# %% [markdown]
# ## 5. Which ranks average which gradient
#
# `train_ep.py` runs 4 ranks as dp 2 × ep 2: ranks 0 and 1 form one expert-parallel row, 2 and 3
# another, and ranks 0 and 2 hold copies of experts 0 and 1. Take a one-number expert, y = w x,
# and give every rank's token to expert 0: each rank's loss is w x_r, and the loss trained is
# their mean, whose gradient is the mean of the four x. After the backward, the copy on rank 0
# holds the gradient of row 0's tokens (x_0 + x_1), the copy on rank 2 that of row 1's.

# %%
x = torch.tensor([1.0, 2.0, 3.0, 4.0])  # each rank's token
want = x.mean()  # the gradient of the mean of the four losses
on_copy = {0: x[0] + x[1], 2: x[2] + x[3]}  # what each copy's backward leaves
print("sum over the copies / W:      ", ((on_copy[0] + on_copy[2]) / 4).item())
print("mean over the copies (DDP's): ", ((on_copy[0] + on_copy[2]) / 2).item())
print("the gradient of the mean loss:", want.item())

# %% [markdown]
# Averaging the copies, as DDP would, counts every token twice here (ep times in general). Task
# 11_5 writes the rule for every parameter; the lesson's test checks `train_ep.py` against one
# process, capacity and auxiliary loss included.
