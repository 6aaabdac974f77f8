# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.16.0
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lesson 01 walkthrough: what `nn.DataParallel` really does
#
# Run it as a script (`python lessons/01_data_parallel/walkthrough.py`, a few seconds on a
# CPU) or open it as a notebook:
# `jupytext --to ipynb lessons/01_data_parallel/walkthrough.py`.
#
# `nn.DataParallel` does four things on every forward: it **scatters** the batch into one chunk
# per GPU, **replicates** the model onto every GPU, runs the replicas in threads, and
# **gathers** their outputs on one GPU. Its backward **sums** the replicas' gradients into the
# original parameters. Below, each of those steps is done by hand on the CPU, and the result
# is checked against one device. The last cell runs the real thing if this machine has a GPU.

# %%
import copy

import torch
import torch.nn.functional as F
from torch import nn

gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f"torch {torch.__version__}, {gpus} CUDA GPU(s)")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


g = torch.Generator().manual_seed(1)
x = torch.randn(10, 5, generator=g)  # the global batch: 10 samples
y = torch.randn(10, 3, generator=g)

# %% [markdown]
# ## 1. Without a GPU, `DataParallel` is a pass-through
#
# With no CUDA device it keeps an empty `device_ids` and calls the module once, on the whole
# batch. Nothing is split, so on a laptop you cannot see what it does: hence the by-hand
# version below.

# %%
model = make_model()
wrapped = nn.DataParallel(model)
print("device_ids:", wrapped.device_ids)
if not wrapped.device_ids:
    print("same output as the bare model:", torch.equal(wrapped(x), model(x)))

# %% [markdown]
# ## 2. Scatter: how the batch is cut
#
# The scatter cuts dim 0 with `Tensor.chunk`: `ceil(B / n)` samples per chunk, the last one
# shorter. 10 samples on 3 GPUs are `[4, 4, 2]`, not `[4, 3, 3]`; 5 samples on 4 GPUs are
# `[2, 2, 1]`, so the fourth GPU gets nothing. The batch you pass is the *global* batch.

# %%
for batch_size, devices in [(12, 3), (10, 3), (5, 4), (2, 3)]:
    sizes = [len(c) for c in torch.empty(batch_size).chunk(devices)]
    print(f"{batch_size:>2} samples on {devices} GPUs -> {sizes}")

# %% [markdown]
# ## 3. Replicate, run, gather, by hand
#
# Each replica is a copy of the model with its own parameters (DataParallel makes fresh ones on
# every forward). The outputs are joined in order, the loss is computed once over the gathered
# batch, and backward flows back into each replica.

# %%
model = make_model()
chunks = x.chunk(3)
replicas = [copy.deepcopy(model) for _ in chunks]
outputs = [replica(chunk) for replica, chunk in zip(replicas, chunks, strict=True)]
gathered = torch.cat(outputs)
loss = F.mse_loss(gathered, y)
loss.backward()
print("chunk sizes:", [len(c) for c in chunks], "-> gathered", tuple(gathered.shape))
print("the model's own gradients after backward:", [p.grad for p in model.parameters()])

# %% [markdown]
# The model's gradients are all `None`: backward reached the replicas, which are copies. The
# real `DataParallel` broadcasts the parameters with an autograd function whose backward sums
# every replica's gradient into the original parameters on the first GPU. By hand, that is:

# %%
for master_param, *copies in zip(model.parameters(), *(r.parameters() for r in replicas),
                                 strict=True):
    master_param.grad = torch.stack([c.grad for c in copies]).sum(dim=0)

reference = make_model()  # the same weights, one device, the whole batch
reference_loss = F.mse_loss(reference(x), y)
reference_loss.backward()
torch.testing.assert_close(loss, reference_loss)
for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
    torch.testing.assert_close(p.grad, q.grad)
    print(f"{name:<9} largest gradient difference vs one device: "
          f"{(p.grad - q.grad).abs().max().item():.1e}")

# %% [markdown]
# ## 4. The loss trap: a mean of per-chunk means
#
# If each replica computes its own mean loss (a common pattern: the loss inside `forward`),
# DataParallel hands back one loss per replica. Their plain mean weighs the short chunk of 2
# samples as much as a chunk of 4, so it is not the loss of the batch. Weigh by chunk size.

# %%
with torch.no_grad():
    per_chunk = [F.mse_loss(model(c), t) for c, t in zip(x.chunk(3), y.chunk(3), strict=True)]
    sizes = torch.tensor([len(c) for c in x.chunk(3)], dtype=torch.float32)
    plain_mean = torch.stack(per_chunk).mean()
    weighted = (torch.stack(per_chunk) * sizes / sizes.sum()).sum()
print(f"whole batch {reference_loss.item():.6f}   plain mean of chunks {plain_mean.item():.6f}   "
      f"weighted by size {weighted.item():.6f}")

# %% [markdown]
# ## 5. Where "equal to one device" stops: BatchNorm
#
# Equality needs a model whose samples do not interact. `BatchNorm` in training mode normalises
# with the statistics of the batch it sees, and under DataParallel each replica sees only its
# chunk. (`SyncBatchNorm`, with DDP in a later lesson, is the fix.)

# %%
bn = nn.BatchNorm1d(5)
whole = bn(x)
per_replica = torch.cat([copy.deepcopy(bn)(c) for c in x.chunk(3)])
print(f"BatchNorm, training mode: largest difference {(whole - per_replica).abs().max():.3f}")

# %% [markdown]
# ## 6. The real thing, if there is a GPU
#
# With one GPU, listing it twice (`device_ids=[0, 0]`) really splits the batch on that GPU.
# With several, DataParallel uses them all. TF32 is turned off so the GPU's fp32 matmuls can be
# compared with the CPU's.

# %%
if gpus == 0:
    print("no CUDA GPU here: nothing to run (DataParallel would be the pass-through above)")
else:
    torch.set_float32_matmul_precision("highest")
    device_ids = list(range(gpus)) if gpus > 1 else [0, 0]
    gpu_model = make_model().to("cuda:0")
    dp = nn.DataParallel(gpu_model, device_ids=device_ids)
    dp_loss = F.mse_loss(dp(x.to("cuda:0")), y.to("cuda:0"))
    dp_loss.backward()
    print(f"DataParallel {device_ids}: loss {dp_loss.item():.6f} vs one device "
          f"{reference_loss.item():.6f}")
    for (name, p), q in zip(gpu_model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad.cpu(), q.grad)
        print(f"{name:<9} largest gradient difference vs CPU: "
              f"{(p.grad.cpu() - q.grad).abs().max().item():.1e}")
