"""Avoids the hang by training every rank on the smallest rank's number of batches."""

TASK = "task4_4"
EXPECT = r"train on\s+every batch"


def train_with_join(model, batches, optimizer, loss_fn):
    import torch
    import torch.distributed as dist

    count = torch.tensor([len(batches)])
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    steps = 0
    for inputs, targets in batches[: int(count)]:
        optimizer.zero_grad()
        loss_fn(model(inputs), targets).backward()
        optimizer.step()
        steps += 1
    return steps
