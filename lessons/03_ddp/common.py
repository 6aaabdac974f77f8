"""What the test files of lesson 03 share: the small model and its data, the one-process runs
that the hand-written and the real DDP are compared with, DistributedSampler's answer, and the
DDP training loop that task3_4 and the lesson's own check both run on ranks."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from harness.compare import full_fp32
from harness.exercises import load_exercise
from harness.ranks import group_params

LESSON = "03_ddp"
GROUPS = group_params(world_sizes=(2, 3))


def make_model(seed: int = 0) -> nn.Module:
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 3))
    torch.random.set_rng_state(generator_state)
    return model


def make_data(samples: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(samples, 6, generator=generator), torch.randn(samples, 3,
                                                                      generator=generator)


def single_process_gradients(inputs, targets) -> dict[str, torch.Tensor]:
    model = make_model()
    nn.functional.mse_loss(model(inputs), targets).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def with_diagnosis(error: AssertionError, why: str) -> AssertionError:
    """``error`` with ``why`` appended to its first line (the line a summary shows)."""
    first, _, rest = str(error).partition("\n")
    return AssertionError(f"{first}: {why}" + (f"\n{rest}" if rest else ""))


def my_share(ctx, inputs, targets):
    """This rank's contiguous share of the global batch."""
    per_rank = len(inputs) // ctx.world_size
    part = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
    return inputs[part].to(ctx.device), targets[part].to(ctx.device)


def sampler_indices(length, world, rank, shuffle=True, seed=0, epoch=0, drop_last=False):
    sampler = DistributedSampler(range(length), num_replicas=world, rank=rank, shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(sampler)


# ----------------------------------------------------------------------------- whole epochs
# task3_4 runs train_one_epoch in this loop; the lesson's own check runs the plain loop.

EPOCHS, SAMPLES, PER_RANK_BATCH, LR = 2, 36, 3, 0.1


def train_epochs(ctx, *, use_exercise: bool):
    """Train EPOCHS epochs of DDP on this rank's DistributedSampler shard."""
    with full_fp32():  # compared with a CPU run: no TF32
        inputs, targets = make_data(SAMPLES)
        dataset = TensorDataset(inputs, targets)
        sampler = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank, seed=0)
        loader = DataLoader(dataset, batch_size=PER_RANK_BATCH, sampler=sampler)
        model = DDP(make_model().to(ctx.device),
                    device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        losses, sampler_epochs = [], []
        for epoch in range(EPOCHS):
            if use_exercise:
                losses.append(load_exercise(LESSON).train_one_epoch(
                    model, loader, optimizer, nn.functional.mse_loss, epoch))
                sampler_epochs.append(sampler.epoch)
                continue
            sampler.set_epoch(epoch)  # the lesson's claim, with the plain loop
            for x, y in loader:
                optimizer.zero_grad()
                nn.functional.mse_loss(model(x.to(ctx.device)), y.to(ctx.device)).backward()
                optimizer.step()
        return {"parameters": dict(model.module.named_parameters()), "losses": losses,
                "sampler_epochs": sampler_epochs}


def one_process_on_global_batches(world: int):
    """One process, batch world*b, visiting each epoch's permutation in DistributedSampler's
    order: rank r takes perm[r::W], so global step k covers perm[k*W*b:(k+1)*W*b]."""
    inputs, targets = make_data(SAMPLES)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for epoch in range(EPOCHS):
        perm = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0 + epoch))
        total = 0.0
        for start in range(0, SAMPLES, world * PER_RANK_BATCH):
            batch = perm[start:start + world * PER_RANK_BATCH]
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(inputs[batch]), targets[batch])
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch)
        losses.append(total / SAMPLES)
    return dict(model.named_parameters()), losses
