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
# # Lesson 05 walkthrough: where the memory goes, and how sharding gives it back
#
# Four steps, all on a CPU: count the bytes of training state per parameter, see with plain
# tensors why an all-reduce is a reduce-scatter followed by an all-gather, build a model of
# shapes alone on the meta device, then train the running example with FSDP2 under `torchrun`,
# started from here as a subprocess, and read what each rank stores.

# %%
import os
import subprocess
import sys
from pathlib import Path

import torch

# Works from the repository root (as a script) and from this folder (as a notebook).
HERE = (Path("lessons/05_sharded_data_parallel") if Path("lessons/05_sharded_data_parallel")
        .is_dir() else Path("."))
sys.path.insert(0, str(HERE.parent))  # lessons/, where gpt/ lives
from gpt import GPT, SIZES, CharDataset, GPTConfig  # noqa: E402

# %% [markdown]
# ## 1. Bytes per parameter
#
# Training with AdamW in fp32 keeps, for every parameter: the parameter (4 bytes), its gradient
# (4) and AdamW's two moments, `exp_avg` and `exp_avg_sq` (4 + 4). Ask AdamW itself what it
# keeps after one step:

# %%
layer = torch.nn.Linear(4, 3)
optimizer = torch.optim.AdamW(layer.parameters())
layer(torch.randn(2, 4)).sum().backward()
optimizer.step()
for name, value in optimizer.state[layer.weight].items():
    print(f"{name:<11} shape {tuple(value.shape)!s:<7} {value.dtype}")

# %% [markdown]
# So 16 bytes per parameter on every DDP rank, plus activations. For the running example:

# %%
dataset = CharDataset(SIZES["tiny"]["block_size"])
psi = GPT(GPTConfig.named("tiny", vocab_size=dataset.vocab_size)).num_parameters()
print(f"{psi:,} parameters x 16 bytes = {16 * psi / 1e3:,.1f} kB on every DDP rank")


def per_rank(psi: int, world: int, stage: int, param=4, grad=4, state=8) -> int:
    """ZeRO's accounting: stage 1 shards the state, 2 the gradients too, 3 the parameters too."""
    shard = -(-psi // world)
    return ((shard if stage >= 3 else psi) * param + (shard if stage >= 2 else psi) * grad
            + (shard if stage >= 1 else psi) * state)


for stage, name in enumerate(["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3 / FSDP"]):
    print(f"{name:<14} 2 ranks: {per_rank(psi, 2, stage) / 1e3:7.1f} kB per rank   "
          f"7.5B parameters, 64 GPUs, mixed precision: "
          f"{per_rank(7_500_000_000, 64, stage, 2, 2, 12) / 1e9:6.1f} GB per GPU")

# %% [markdown]
# The right-hand column is the ZeRO paper's own example: 120 GB per GPU under DDP does not fit
# on an 80 GB GPU; fully sharded, 1.9 GB does. (This `per_rank` is task5_1's answer: try the
# exercise before you read it twice.)

# %% [markdown]
# ## 2. An all-reduce is a reduce-scatter, then an all-gather
#
# Pretend there are 3 ranks, each with its own gradient of 6 elements. An all-reduce gives
# every rank the sum of all three. A reduce-scatter gives rank r only piece r of that sum; an
# all-gather then hands every rank every piece. Both end in the same place, and each moves
# (W - 1)/W of the tensor per rank, half the all-reduce's 2 (W - 1)/W.

# %%
world = 3
gradients = [torch.arange(6.0) * (rank + 1) for rank in range(world)]  # one per rank
all_reduced = sum(gradients)
pieces = [sum(g.chunk(world)[r] for g in gradients) for r in range(world)]  # reduce-scatter
all_gathered = torch.cat(pieces)  # what every rank has after the all-gather
print("all-reduce:                ", all_reduced.tolist())
print("reduce-scatter pieces:     ", [p.tolist() for p in pieces])
print("then all-gather:           ", all_gathered.tolist())
assert torch.equal(all_reduced, all_gathered)

# %% [markdown]
# ZeRO-1 and ZeRO-2 keep the reduce-scatter (each rank needs only its piece of the averaged
# gradient, to step its piece of the parameters) and move the all-gather after the optimizer
# step: the same two halves, the same traffic as DDP. ZeRO-3 all-gathers the parameters for
# the forward and again for the backward: 1.5 times DDP's traffic.

# %% [markdown]
# ## 3. A model that is only shapes: the meta device
#
# A model too large for one rank cannot be built whole and sharded afterwards. On the `meta`
# device a model has shapes and no memory; `to_empty` allocates memory for it (uninitialised),
# and the running example's `init_weights`, given the same seed, writes the values an eager
# build has. With `fully_shard` between the two steps each rank allocates only its shards (the
# README's section on the meta device, and task5_8); here, one process, without sharding:

# %%
config = GPTConfig.named("tiny", vocab_size=dataset.vocab_size)
with torch.device("meta"):
    shapes_only = GPT(config, seed=0)
weight = shapes_only.blocks[0].mlp.up_proj.weight
print(f"device {weight.device}, shape {tuple(weight.shape)}, address {weight.data_ptr()}")
shapes_only.to_empty(device="cpu")
shapes_only.init_weights(torch.Generator().manual_seed(0))
same = all(torch.equal(a, b) for a, b in zip(shapes_only.parameters(), GPT(config, seed=0)
                                              .parameters(), strict=True))
print("the same values as GPT(config, seed=0):", same)

# %% [markdown]
# ## 4. FSDP2 on the running example, launched from here
#
# A notebook kernel is one process: start the ranks with `torchrun` in a subprocess (lesson 03
# explains why). Each rank prints nothing but rank 0, which reports what every rank stores.

# %%
command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", str(HERE / "train_fsdp.py"), "--epochs", "1",
           "--batch-size", "8", "--train-windows", "320"]
run = subprocess.run(command, capture_output=True, text=True, timeout=180,
                     env={**os.environ, "OMP_NUM_THREADS": "1"})
print(run.stdout)
assert run.returncode == 0, run.stderr

# %% [markdown]
# Each rank stores half of the parameters, half of the gradients and half of AdamW's state:
# 447 kB instead of DDP's 893 kB. The two ranks' numbers differ by about a kilobyte: FSDP2
# cuts each parameter along its first dimension, and the 61 rows of the embedding and of the
# head (one per character) do not split evenly in two: rank 0's shard has 31 of them, rank 1's
# 30. That is the logical shard the script counts; the storage FSDP2 allocates is padded to 31
# rows on both ranks. The
# lesson's text shows how this script differs from lesson 03's (the diff is short), and the
# exercises build ZeRO stages 1 to 3 by hand.

# %% [markdown]
# ## 5. What a forward keeps for the backward
#
# Everything autograd saves passes through a saved-tensors hook. Count each storage once, the
# parameters aside: the tiny model keeps 16C + H + 4 floats per token in each block (the
# README's table names each), and a checkpointed block only its input. task5_9 turns this count,
# and what a step adds for a moment, into a prediction of a rank's peak.

# %%
def kept_bytes(model, ids):
    parameters = {p.untyped_storage()._cdata for p in model.parameters()}
    kept = {}

    def pack(tensor):
        if tensor.untyped_storage()._cdata not in parameters:
            kept[tensor.untyped_storage()._cdata] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(ids, ids)
    return sum(kept.values())


config = GPTConfig(vocab_size=65, block_size=32, n_layer=4, n_head=4, n_embd=32)
ids = torch.randint(65, (8, 32))
with_four, with_five = (kept_bytes(GPT(GPTConfig(**{**config.__dict__, "n_layer": n})), ids)
                        for n in (4, 5))
per_token = (with_five - with_four) / (4 * ids.numel())
print(f"one more block keeps {with_five - with_four:,} bytes: {per_token:.0f} floats per token;"
      f" 16C + H + 4 = {16 * 32 + 4 + 4}")
