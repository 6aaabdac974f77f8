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
# # Lesson 02 walkthrough: one model on two devices, then pipelined
#
# Run it as a script (`python lessons/02_model_parallel/walkthrough.py`, a few seconds on a
# CPU) or open it as a notebook:
# `jupytext --to ipynb lessons/02_model_parallel/walkthrough.py`.
#
# When a model does not fit on one device, put its first layers on one device and the rest on
# another, and move the activations between them. Below: why a model stops fitting, the split
# itself, proof that autograd carries the gradients back across devices, what the split costs
# (one device works at a time), and how micro-batches win most of that back without changing
# a single gradient. Without GPUs, both "devices" are the CPU: the mechanics are the same.

# %%
import copy
import time

import torch
import torch.nn.functional as F
from torch import nn

gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
if gpus >= 2:
    devices = [torch.device("cuda:0"), torch.device("cuda:1")]
elif gpus == 1:
    devices = [torch.device("cuda:0"), torch.device("cpu")]
else:
    devices = [torch.device("cpu"), torch.device("cpu")]
print(f"torch {torch.__version__}, {gpus} CUDA GPU(s); the two stages go on "
      f"{devices[0]} and {devices[1]}")

# %% [markdown]
# ## 1. Why a model stops fitting
#
# Training with Adam in fp32 keeps, for every parameter, the weight (4 bytes), its gradient
# (4 bytes) and Adam's two running averages (8 bytes): 16 bytes per parameter, before a single
# activation is stored. Data parallelism (lessons 01 and 03) copies all of it onto every GPU,
# so it cannot help here.

# %%
for billions in (1, 7, 13, 70):
    gigabytes = billions * 1e9 * 16 / 1e9
    verdict = "fits" if gigabytes <= 80 else "does not fit"
    print(f"{billions:>3}B parameters: {gigabytes:6,.0f} GB of weights, gradients and Adam "
          f"state -> {verdict} on one 80 GB GPU")

# %% [markdown]
# ## 2. The split: stage 0 on one device, stage 1 on the other
#
# Cut the model between two layers. Each half moves to its device with `.to()`, which moves
# parameters and buffers in place. The forward moves the batch to the first device and the
# activations to the second; the output (and so the loss) ends on the second device.

# %%
torch.manual_seed(0)
layers = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                       nn.Linear(32, 4))
unsplit = copy.deepcopy(layers)  # the reference: the same weights, on one device (the CPU)


class TwoStages(nn.Module):
    def __init__(self, layers: nn.Sequential, devices, cut: int):
        super().__init__()
        self.devices = devices
        self.stage0 = layers[:cut].to(devices[0])
        self.stage1 = layers[cut:].to(devices[1])

    def forward(self, x):
        x = self.stage0(x.to(self.devices[0]))
        return self.stage1(x.to(self.devices[1]))


model = TwoStages(layers, devices, cut=2)
for name, param in model.named_parameters():
    print(f"{name:<16} {str(tuple(param.shape)):<9} on {param.device}")

# %% [markdown]
# ## 3. Autograd carries the gradients back
#
# `x.to(other_device)` is an operation autograd records. Its backward copies the gradient back
# to the device `x` came from, so `loss.backward()` reaches stage 0 with no extra code, and one
# optimizer updates parameters on both devices. The result is the unsplit model's, to the last
# bits of float rounding (on GPUs, with TF32 off).

# %%
g = torch.Generator().manual_seed(1)
inputs, targets = torch.randn(10, 8, generator=g), torch.randn(10, 4, generator=g)

outputs = model(inputs)
loss = F.mse_loss(outputs, targets.to(outputs.device))  # the loss lives with the output
loss.backward()
reference_loss = F.mse_loss(unsplit(inputs), targets)
reference_loss.backward()

print(f"output on {outputs.device}; loss {loss.item():.6f} split, "
      f"{reference_loss.item():.6f} on one device")
split_grads = [p.grad.cpu() for p in model.parameters()]
worst = max((a - b.grad).abs().max().item() for a, b in zip(split_grads, unsplit.parameters(),
                                                                 strict=True))
print(f"largest difference between the split and unsplit gradients: {worst:.2e}")

# %% [markdown]
# ## 4. The cost: one device works at a time
#
# Stage 1 cannot start before stage 0 has finished, and in the backward stage 0 waits for the
# gradient from stage 1. With `p` stages, each device is busy `1 / p` of the time. Below is the
# schedule on a grid of time steps (one forward or one backward of one micro-batch per step):
# `F0` is the forward of micro-batch 0, `B0` its backward, `.` is idle.


# %%
def gpipe_grid(num_stages: int, num_micro_batches: int) -> list[list[str]]:
    """GPipe: stage s runs micro-batch i's forward at step s + i; backward mirrored after."""
    p, m = num_stages, num_micro_batches
    phase = m + p - 1
    grid = [["."] * (2 * phase) for _ in range(p)]
    for s in range(p):
        for i in range(m):
            grid[s][s + i] = f"F{i}"
            grid[s][phase + (p - 1 - s) + i] = f"B{i}"
    return grid


def show(num_stages: int, num_micro_batches: int) -> None:
    grid = gpipe_grid(num_stages, num_micro_batches)
    idle = sum(slot == "." for row in grid for slot in row) / (len(grid) * len(grid[0]))
    print(f"{num_stages} stages, {num_micro_batches} micro-batch(es): idle {idle:.0%} "
          f"(the formula (p - 1) / (m + p - 1) = "
          f"{(num_stages - 1) / (num_micro_batches + num_stages - 1):.0%})")
    for s, row in enumerate(grid):
        print(f"  stage {s}: " + " ".join(f"{slot:>3}" for slot in row))


show(2, 1)  # the naive split: each device idle half the time
show(4, 1)  # four stages: idle three quarters of the time

# %% [markdown]
# ## 5. Micro-batches fill the pipeline (GPipe)
#
# Cut the batch into `m` micro-batches. While stage 1 works on micro-batch 0, stage 0 already
# works on micro-batch 1. Only the start and the end of the step (the "bubble") stay idle:
# `(p - 1) / (m + p - 1)` of the time, which shrinks as `m` grows.

# %%
show(2, 4)
show(4, 8)

# %% [markdown]
# ## 6. The loss of a micro-batch must be weighted by its size
#
# The gradients must be those of the whole batch's mean loss, or micro-batching would change
# training. With 10 samples in 4 micro-batches of 3, 3, 2 and 2, each micro-batch's *mean* loss
# must count `size / 10`, not `1 / 4`: the two agree only when the sizes are equal.


# %%
def micro_batch_grads(model, inputs, targets, m, weighting):
    model.zero_grad()
    batch = inputs.shape[0]
    for x, y in zip(inputs.tensor_split(m), targets.tensor_split(m), strict=True):
        weight = x.shape[0] / batch if weighting == "size / B" else 1 / m
        (F.mse_loss(model(x), y) * weight).backward()
    return [p.grad.clone() for p in model.parameters()]


net = copy.deepcopy(unsplit)
net.zero_grad()
F.mse_loss(net(inputs), targets).backward()
full = [p.grad.clone() for p in net.parameters()]
for m in (2, 4):
    sizes = [len(c) for c in inputs.tensor_split(m)]
    for weighting in ("size / B", "1 / m"):
        grads = micro_batch_grads(net, inputs, targets, m, weighting)
        diff = max((a - b).abs().max().item() for a, b in zip(grads, full, strict=True))
        print(f"m = {m} {str(sizes):<13} weighted by {weighting:<8}: largest gradient "
              f"difference from the full batch {diff:.1e}")

# %% [markdown]
# (Here each micro-batch's backward runs right after its forward, which is plain gradient
# accumulation. GPipe runs every forward first and the backward after; the sum, and so every
# gradient, is the same. The graded exercise and `pipeline_sweep.py` use GPipe's order.)
#
# ## 7. What it costs on this machine
#
# The same small pipeline, timed for several `m`. On one CPU both stages share the same cores,
# so nothing overlaps: more micro-batches only add overhead. On two GPUs, each device runs the
# kernels queued on it asynchronously, so the stages do overlap; `pipeline_sweep.py` measures
# that with a model big enough to matter.

# %%
torch.manual_seed(0)
big = nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(256, 256), nn.ReLU())])
stages = [big[:4].to(devices[0]), big[4:].to(devices[1])]
x, y = torch.randn(512, 256).to(devices[0]), torch.randn(512, 256).to(devices[1])


def sync_all(devices):
    """Wait for every device's queued work: CUDA kernels run asynchronously to Python."""
    for device in set(devices):
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def gpipe_step(m):
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    # Every forward first (on GPUs, stage 0 runs ahead while stage 1 catches up), then backward.
    outputs = [stages[1](stages[0](xi).to(devices[1])) for xi in x.tensor_split(m)]
    loss = sum(F.mse_loss(out, yi) * (len(yi) / len(y))
               for out, yi in zip(outputs, y.tensor_split(m), strict=True))
    loss.backward()


for m in (1, 2, 4, 8):
    gpipe_step(m)  # warm-up
    sync_all(devices)
    start = time.perf_counter()
    for _ in range(3):
        gpipe_step(m)
    sync_all(devices)
    print(f"m = {m}: {(time.perf_counter() - start) / 3 * 1000:6.1f} ms per forward + backward")

# %% [markdown]
# ## Where next
#
# - Splitting a model by hand works in one process, for a few devices.
#   `torch.distributed.pipelining` runs one process per stage, sends the activations between
#   them, and offers GPipe and other schedules (1F1B, interleaved) that keep fewer
#   micro-batches' activations alive at a time.
# - Tensor parallelism splits each layer's matrices across GPUs instead of cutting between
#   layers; it needs fast links because every layer communicates.
# - When the model fits, data parallelism (DDP, lesson 03) is the faster choice; large jobs
#   combine both: data parallel across groups of GPUs that each hold one pipeline.
