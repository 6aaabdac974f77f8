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
# # Lesson 03 walkthrough: sharding, averaging, launching
#
# Three steps, all on a CPU: see how `DistributedSampler` splits a dataset, check by hand why
# averaging per-rank gradients equals one big batch, then run real DDP under `torchrun`,
# started from here as a subprocess (the safe way to use several processes from a notebook).

# %%
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DistributedSampler

# Works from the repository root (as a script) and from this folder (as a notebook).
HERE = Path("lessons/03_ddp") if Path("lessons/03_ddp").is_dir() else Path(".")

# %% [markdown]
# ## 1. Who reads which samples
#
# `DistributedSampler` needs no process group when you pass `num_replicas` and `rank`, so we
# can ask it what each of 3 ranks would read from a dataset of 10.

# %%
for epoch in (0, 1):
    shards = []
    for rank in range(3):
        sampler = DistributedSampler(range(10), num_replicas=3, rank=rank, seed=0)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    print(f"epoch {epoch}: " + "  ".join(f"rank {r}: {s}" for r, s in enumerate(shards)))

# %% [markdown]
# Each rank gets 4 indices: 12 slots for 10 samples, so two samples are read twice (the
# padding). The order changes with the epoch because the permutation is seeded with
# `seed + epoch`; without `set_epoch` every epoch would repeat the first one.

# %% [markdown]
# ## 2. Why averaging gradients equals one big batch
#
# Pretend there are two ranks: each computes the gradient of the mean loss on its half of
# the batch. The average of the two gradients is the gradient on the whole batch.

# %%
torch.manual_seed(0)
model = nn.Linear(4, 1)
inputs, targets = torch.randn(8, 4), torch.randn(8, 1)


def gradient(x, y):
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    return model.weight.grad.clone()


whole = gradient(inputs, targets)
halves = [gradient(inputs[:4], targets[:4]), gradient(inputs[4:], targets[4:])]
averaged = (halves[0] + halves[1]) / 2
print("whole batch :", whole)
print("averaged    :", averaged)
print("largest difference:", (whole - averaged).abs().max().item())

# %% [markdown]
# The difference is fp32 rounding. With `reduction="sum"` the average would be half the
# whole-batch gradient: that is why DDP needs mean losses.

# %% [markdown]
# ## 3. Real DDP, launched from here
#
# `train_ddp.py` is lesson 00's training of the small GPT, plus DDP. A notebook kernel is one
# process: it cannot *become* two ranks, and `mp.spawn` from a notebook fails (spawned
# children cannot import functions defined in a cell) or leaves the cell waiting on children
# that died. Launch the script with `torchrun` in a subprocess instead, with a timeout, and
# read what it prints. `--batch-size 8` is per process: 2 ranks x 8 make a global batch of 16.

# %%
command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", str(HERE / "train_ddp.py"), "--epochs", "1",
           "--batch-size", "8"]
run = subprocess.run(command, capture_output=True, text=True, timeout=180,
                     env={**os.environ, "OMP_NUM_THREADS": "1"})
print(run.stdout)
assert run.returncode == 0, run.stderr

# %% [markdown]
# The first line says which backend was chosen (gloo here: no GPUs) and the global batch.
# Only rank 0 prints; its train loss is the mean over both ranks' windows (an all-reduce).
# `python lessons/03_ddp/train_ddp.py --epochs 1 --batch-size 16`, one process with the
# same global batch, prints the same losses: that equality is what the lesson's tests check.
# Next, in the lesson text: how to write `setup`, `average_gradients` and the rest
# yourself, and the tests that grade them.
