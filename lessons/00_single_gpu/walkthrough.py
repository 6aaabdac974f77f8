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
# # Lesson 00 walkthrough: one device, done right
#
# Run it as a script (`python lessons/00_single_gpu/walkthrough.py`) or open it as a notebook
# (`jupytext --to ipynb lessons/00_single_gpu/walkthrough.py`). It takes a few seconds on a CPU;
# with a GPU the same cells run on CUDA, and the timing cell shows why you must synchronize.
#
# Five steps: choose the device, move the data, take one training step, evaluate exactly,
# time honestly.

# %%
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# %% [markdown]
# ## 1. Choose the device once
#
# Decide at the top, keep the answer in one variable, and pass it on. Nothing below says
# `"cuda"` again, so the same code runs on a laptop and on a GPU server.

# %%
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
print("device:", device)

# %% [markdown]
# ## 2. Move the data
#
# Data is made on the host (CPU). On CUDA, a `DataLoader` with `pin_memory=True` puts each batch
# in page-locked memory, which the GPU can copy from by DMA; `non_blocking=True` then lets the
# copy run while the CPU carries on queueing work. On the CPU both are no-ops.

# %%
g = torch.Generator().manual_seed(0)
inputs = torch.randn(1000, 8, generator=g)
labels = (inputs[:, 0] * inputs[:, 1] > 0).long()  # 1 where the first two coordinates agree in sign
train_set = TensorDataset(inputs[:800], labels[:800])
val_set = TensorDataset(inputs[800:], labels[800:])  # 200 samples: 3 full batches of 64 and 8

pin = device.type == "cuda"
train_loader = DataLoader(train_set, batch_size=64, shuffle=True, pin_memory=pin,
                          generator=torch.Generator().manual_seed(0))
val_loader = DataLoader(val_set, batch_size=64, pin_memory=pin)

x, y = next(iter(train_loader))
print("from the loader:", x.device, "pinned:", x.is_pinned())
x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
print("after .to(device):", x.device)

# %% [markdown]
# ## 3. Model first, then the optimizer
#
# Move the model before creating the optimizer: the optimizer holds references to the
# parameters, and its state (AdamW's two moments per weight) is created next to them.

# %%
torch.manual_seed(0)  # the initial weights come from the global generator
model = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 2)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
print("first weight on:", next(model.parameters()).device)

# %% [markdown]
# ## 4. One training step
#
# Clear the old gradients, forward, loss, backward, step. `loss.item()` copies one number back
# to the host; on a GPU that makes the CPU wait for every queued kernel, so take it when you
# need it, not for free on every step.

# %%
model.train()
optimizer.zero_grad(set_to_none=True)
loss = F.cross_entropy(model(x), y)
loss.backward()
optimizer.step()
print(f"loss of the first batch: {loss.item():.4f} (a Python {type(loss.item()).__name__})")

for _epoch in range(3):
    for xb, yb in train_loader:
        xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(xb), yb).backward()
        optimizer.step()
print(f"loss of the same batch after 3 epochs: {F.cross_entropy(model(x), y).item():.4f}")

# %% [markdown]
# ## 5. Evaluate exactly
#
# The validation set has 200 samples: batches of 64, 64, 64 and 8. Averaging the four batch
# means counts the 8 samples as if they were 64. Sum the per-sample losses and divide once.

# %%
model.eval()
batch_means, loss_sum, seen = [], 0.0, 0
with torch.no_grad():
    for xb, yb in val_loader:
        xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
        batch_means.append(F.cross_entropy(model(xb), yb).item())
        loss_sum += F.cross_entropy(model(xb), yb, reduction="sum").item()
        seen += yb.shape[0]
model.train()
print(f"exact mean loss per sample: {loss_sum / seen:.4f}")
print(f"mean of batch means:        {sum(batch_means) / len(batch_means):.4f}  (wrong)")

# %% [markdown]
# ## 6. Time it honestly
#
# On CUDA, a PyTorch call queues a kernel and returns at once. A clock read without
# `torch.cuda.synchronize()` measures how fast Python queues work, not how fast the GPU does it.
# The first steps also pay one-off costs (memory allocation, kernel selection), so warm up first.

# %%
def wait_for_device():
    if device.type == "cuda":
        torch.cuda.synchronize(device)


big = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)).to(device)
big_optimizer = torch.optim.AdamW(big.parameters(), lr=1e-4)
batch = torch.randn(256, 512, device=device)


def step():
    big_optimizer.zero_grad(set_to_none=True)
    big(batch).square().mean().backward()
    big_optimizer.step()


for _ in range(3):  # warm-up, not timed
    step()
wait_for_device()

start = time.perf_counter()
for _ in range(10):
    step()
queued = time.perf_counter() - start  # no sync: on CUDA only the queueing is measured
wait_for_device()
finished = time.perf_counter() - start
print(f"clock read before synchronize: {1000 * queued / 10:.2f} ms/step")
print(f"clock read after synchronize:  {1000 * finished / 10:.2f} ms/step  (the real time)")
print(f"throughput: {10 * batch.shape[0] / finished:,.0f} samples/s")

# %% [markdown]
# On a CPU the two numbers agree: CPU operations finish before they return. On a GPU the first
# can be many times smaller than the second. `train.py` and `fast_one_device.py` in this lesson
# always synchronize before reading the clock.
