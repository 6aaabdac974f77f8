"""Evaluates this rank's shard and returns its accuracy, never combining the ranks."""

TASK = "task4_1"
EXPECT = r"shard only: all-reduce the sums"


def exact_accuracy(model, dataset, batch_size=32):
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, Subset

    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = next(model.parameters()).device
    shard = Subset(dataset, range(rank, len(dataset), world_size))
    correct = total = 0
    with torch.no_grad():
        for inputs, targets in DataLoader(shard, batch_size=batch_size):
            predicted = model(inputs.to(device)).argmax(dim=1)
            correct += int((predicted == targets.to(device)).sum())
            total += len(targets)
    return correct / total
