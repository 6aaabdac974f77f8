"""Averages the ranks' accuracies, so a shard of 5 samples weighs as much as one of 6."""

TASK = "task4_1"
EXPECT = r"mean of the ranks' accuracies"


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
    accuracy = torch.tensor([correct / total], dtype=torch.float64, device=device)
    dist.all_reduce(accuracy)
    return (accuracy / world_size).item()
