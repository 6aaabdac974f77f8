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
# # Lesson 04 walkthrough: two silent pitfalls, and launching safely from a notebook
#
# Everything here runs in this one process, on a CPU, in seconds. First two mistakes that
# raise no error at all (a sampler that never reshuffles, a metric skewed by padding), shown
# without starting any rank: `DistributedSampler` tells us what each rank *would* read. Then
# the one safe way to use several processes from a notebook: a script started by `torchrun`
# in a subprocess, with a timeout. The script we start is the lesson's doctor.

# %%
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils.data import DistributedSampler

# Works from the repository root (as a script) and from this folder (as a notebook).
HERE = Path("lessons/04_pitfalls") if Path("lessons/04_pitfalls").is_dir() else Path(".")

# %% [markdown]
# ## 1. No `set_epoch`: every epoch the same order
#
# With `num_replicas` and `rank` given, `DistributedSampler` needs no process group. Here is
# what rank 0 of 2 reads in three epochs, with and without `set_epoch`.

# %%
for call_set_epoch in (False, True):
    sampler = DistributedSampler(range(8), num_replicas=2, rank=0, shuffle=True, seed=0)
    orders = []
    for epoch in range(3):
        if call_set_epoch:
            sampler.set_epoch(epoch)
        orders.append(list(sampler))
    print(f"set_epoch {'called' if call_set_epoch else 'forgotten'}: {orders}")

# %% [markdown]
# Forgotten, the sampler's epoch stays 0 and its permutation, seeded with `seed + epoch`,
# never changes: every epoch is the first epoch again. Nothing fails; the model just sees
# the data in one fixed order.

# %% [markdown]
# ## 2. Padding skews an evaluation
#
# 11 validation samples on 2 ranks: the sampler pads the order to 12 by repeating sample
# 0. Say the model gets sample 0 wrong and 8 of the 11 right.

# %%
right = torch.tensor([0, 1, 1, 1, 1, 0, 1, 0, 1, 1, 1])
world_size = 2
shards = [list(DistributedSampler(range(11), num_replicas=world_size, rank=r, shuffle=False))
          for r in range(world_size)]
print("what each rank evaluates:", shards)
padded = sum(right[s].sum().item() for s in shards) / sum(len(s) for s in shards)
exact_shards = [list(range(r, 11, world_size)) for r in range(world_size)]  # no padding
mean_of_ranks = sum(right[s].float().mean().item() for s in exact_shards) / world_size
exact = sum(right[s].sum().item() for s in exact_shards) / 11
print(f"counts over padded shards: {padded:.4f}")
print(f"mean of the ranks' accuracies (unpadded shards of 6 and 5): {mean_of_ranks:.4f}")
print(f"counts over unpadded shards: {exact:.4f}   true accuracy: {right.float().mean():.4f}")

# %% [markdown]
# The exact version shards without padding (`range(rank, N, world_size)`: shards may differ
# by one sample, which is fine for evaluation), and adds up *counts*, not accuracies: each
# rank sums its correct answers and its samples, one `all_reduce` adds both, then divide.
# That is task 4.1.

# %% [markdown]
# ## 3. Several processes from a notebook: a subprocess with a timeout
#
# A notebook kernel is one process whose `__main__` is not a file. `mp.spawn` of a function
# defined in a cell fails (the children cannot import it), and `init_process_group` with
# `world_size=2` in the kernel waits for a partner nobody starts. Keep the distributed code
# in a script with an `if __name__ == "__main__":` guard, and start it with `torchrun` in a
# subprocess, with a timeout: a crash or a hang ends the subprocess, not the kernel. On a
# timeout, `subprocess.run` kills torchrun alone (SIGKILL), and its workers run on: give them
# timeouts of their own, as the doctor has, or send torchrun SIGTERM (lab 14's `--fix`).
#
# Here the script is the lesson's doctor, which checks that a barrier and an all-reduce
# work on 2 ranks and ends with a verdict.

# %%
command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(HERE / "doctor.py"), "--timeout", "20", "--sizes", "1"]
run = subprocess.run(command, capture_output=True, text=True, timeout=180,
                     env={**os.environ, "OMP_NUM_THREADS": "1"})
print(run.stdout)
assert run.returncode == 0, run.stderr

# %% [markdown]
# Only rank 0 printed. If a rank had hung, the doctor's own timeouts would have ended the
# run with a verdict naming the step; and `timeout=180` bounds this cell whatever happens.
