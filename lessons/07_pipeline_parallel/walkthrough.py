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
# # Lesson 07 walkthrough: stages, schedules and the bubble
#
# Four steps, all on a CPU: cut the running example into stages, check that, chained, they are
# the model, and time its layers; run the two classic schedules on paper and read their bubble
# and memory; see a mismatched pair of schedules deadlock, on paper; then train the model as a
# pipeline of two processes under `torchrun`, started from here as a subprocess.

# %%
import os
import subprocess
import sys
from pathlib import Path

import torch

# Works from the repository root (as a script) and from this folder (as a notebook).
HERE = (Path("lessons/07_pipeline_parallel") if Path("lessons/07_pipeline_parallel").is_dir()
        else Path("."))
sys.path[:0] = [str(HERE), str(HERE.parent)]  # this folder (the simulator), lessons/ (gpt/)
from gpt import GPT, SIZES, CharDataset, GPTConfig, GPTStage  # noqa: E402
from simulator import Deadlock, reference_schedule, simulate  # noqa: E402

# %% [markdown]
# ## 1. Stages: runs of blocks
#
# `GPTStage(model, start, end)` holds blocks `start` to `end - 1` of the model, the embeddings
# when it starts at block 0 and the head when it ends at the last block. Chained, two stages are
# the model:

# %%
dataset = CharDataset(SIZES["tiny"]["block_size"])
model = GPT(GPTConfig.named("tiny", vocab_size=dataset.vocab_size))
stages = [GPTStage(model, 0, 2), GPTStage(model, 2, 4)]
tokens = torch.randint(0, dataset.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
x = tokens
for stage in stages:
    x = stage(x)
    print(f"after a stage: {tuple(x.shape)}")
print("largest difference from the whole model:", (x - model(tokens)[0]).abs().max().item())
for stage in stages:
    print(f"a stage of {len(stage.blocks)} blocks: {sum(p.numel() for p in stage.parameters()):,} "
          f"parameters")

# %% [markdown]
# What crosses from the first stage to the second is the (batch, tokens, features) activation
# printed first: 2 x 8 x 32 numbers here. The two stages hold different numbers of parameters,
# though they have as many blocks: the embeddings and the head weigh too (task 7_3 balances them).
#
# ### What a layer costs: time is not parameters
#
# A pipeline runs at the pace of its slowest stage in compute. `balance_stages.py` times each
# layer alone, its forward and backward on one micro-batch (the embeddings counted in the first
# layer, the head and the loss in the last). Here on the model with a vocabulary of 4,096, so
# that its embedding and its head each hold as many parameters as 10 blocks:

# %%
from balance_stages import fastest_cut, layer_parameters, layer_seconds, make_batch  # noqa: E402

large_vocabulary = GPT(GPTConfig(vocab_size=4096, block_size=32, n_layer=4, n_head=4,
                                 n_embd=32), seed=0)
ids, targets = make_batch(4096, 16, 32)
seconds = layer_seconds(large_vocabulary, ids, targets, repeats=5, device=torch.device("cpu"))
parameters = layer_parameters(large_vocabulary)
for i, (count, s) in enumerate(zip(parameters, seconds, strict=True)):
    print(f"layer {i}: {count:7,d} parameters, {s * 1e3:5.2f} ms")
print("2 stages by parameters:", fastest_cut(parameters, 2), " by time:", fastest_cut(seconds, 2))

# %% [markdown]
# The embeddings hold ten blocks' worth of parameters, and the first layer costs about what a
# block costs: an embedding is a lookup, one row per token. The head holds as many, and the last
# layer costs several blocks: a multiplication by all of the head's weights, and the loss's
# softmax over 4,096 entries. Counting parameters cuts 2 and 2; timing cuts 3 and 1. The
# lesson's text runs `balance_stages.py`, which runs steps of the pipeline on every cut and shows
# the step following the slowest stage.

# %% [markdown]
# ## 2. Two schedules on paper
#
# The course's simulator runs each stage's list of actions (`("F", i)`, `("B", i)`) under the
# rules real stages follow: a forward waits for the previous stage's output, a backward for the
# next stage's gradient. A forward takes 1 unit of time, a backward 2.

# %%
p, m = 4, 8
for kind in ("gpipe", "1f1b"):
    timeline = simulate(reference_schedule(kind, p, m), m)
    held = [timeline.peak_in_flight(s) for s in range(p)]
    formula = (p - 1) / (m + p - 1)
    print(f"{kind:5s}: idle {timeline.bubble_fraction():.1%} (formula {formula:.1%}), "
          f"activations held per stage {held}")

# %% [markdown]
# The same bubble for both; GPipe holds every micro-batch's activations on every stage, 1F1B at
# most p - s on stage s. Stage 0's first actions under 1F1B:

# %%
print(reference_schedule("1f1b", p, m)[0][:8])

# %% [markdown]
# ### Interleaved 1F1B
#
# Give each of the p ranks v smaller stages (chunks; rank r's chunk c is stage c * p + r) and
# each wait at the ends of the step is a chunk's time, 1/v of a stage's. The actions name the
# chunk, `("F", i, c)`; the simulator's `reference_schedule("interleaved", ...)` is torch's
# `ScheduleInterleaved1F1B` order (task 7_5 writes it).

# %%
for v in (1, 2, 4):
    timeline = simulate(reference_schedule("interleaved", p, m, num_chunks=v), m, posting=None)
    held = [timeline.peak_activations(r) for r in range(p)]
    print(f"{v} chunk(s): idle {timeline.bubble_fraction():.1%} (formula "
          f"{(p - 1) / (v * m + p - 1):.1%}), activations held per rank {held}")

# %% [markdown]
# The bubble falls as (p - 1) / (v m + p - 1); the first ranks pay with a longer warm-up (more
# activations held than 1F1B's 4, 3, 2, 1), and every micro-batch now crosses p v - 1 stage
# boundaries instead of p - 1.

# %% [markdown]
# ### Zero bubble (ZB-H1)
#
# Split each backward into B, the gradient of the stage's input (the stage before waits for
# it), and W, the weights' gradients (nobody waits for them), each half the backward's time.
# Stage s holds back its first s W's to fill the wait at the end of the step:

# %%
zero = reference_schedule("zero-bubble", p, m)
print("stage 1:", zero[1][:10], "...")
timeline = simulate(zero, m, posting=None)
print(f"zero bubble: idle {timeline.bubble_fraction():.1%} (formula (p - 1) / (3 m + p - 1) = "
      f"{(p - 1) / (3 * m + p - 1):.1%}), activations held per stage "
      f"{[timeline.peak_in_flight(s) for s in range(p)]}")

# %% [markdown]
# ## 3. A deadlock, on paper
#
# Stage 0 runs F0 B0 F1 B1; stage 1 runs F0 F1 B0 B1. Stage 0 cannot send micro-batch 1 until it
# has the gradient of micro-batch 0, which stage 1 sends only after micro-batch 1's forward.

# %%
try:
    simulate([[("F", 0), ("B", 0), ("F", 1), ("B", 1)],
              [("F", 0), ("F", 1), ("B", 0), ("B", 1)]], 2)
except Deadlock as error:
    print(error)

# %% [markdown]
# On real ranks this is a hang until the process group's timeout; task 7_2's runner turns it into
# an error naming the stage within its own, shorter timeout.

# %% [markdown]
# ## 4. The running example as a pipeline of two processes
#
# A notebook kernel is one process: start the stages with `torchrun` in a subprocess (lesson 03
# explains why). Rank 0 prints, and reports every stage's busy and idle time.

# %%
command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", str(HERE / "train_pp.py"), "--epochs", "1",
           "--train-windows", "64"]
run = subprocess.run(command, capture_output=True, text=True, timeout=180,
                     env={**os.environ, "OMP_NUM_THREADS": "1"})
print(run.stdout)
assert run.returncode == 0, run.stderr

# %% [markdown]
# The losses are those of one process on the same 4 batches (lesson 03's script prints 3.9443
# and 3.7905 too): a pipeline changes where each block runs, not what it computes. The lesson's
# text shows how this script differs from lesson 03's, and the exercises write the schedules, the
# stage runner and the balanced cut by hand.
