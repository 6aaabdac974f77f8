"""Shards with DistributedSampler, whose padding evaluates one sample twice."""

TASK = "task4_1"
EXPECT = r"padded sample counted twice"


def exact_accuracy(model, dataset, batch_size=32):
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    device = next(model.parameters()).device
    sampler = DistributedSampler(dataset, shuffle=False)
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for inputs, targets in DataLoader(dataset, batch_size=batch_size, sampler=sampler):
            predicted = model(inputs.to(device)).argmax(dim=1)
            totals[0] += (predicted == targets.to(device)).sum()
            totals[1] += len(targets)
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()
