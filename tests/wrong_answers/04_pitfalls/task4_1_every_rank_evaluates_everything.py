"""Every rank evaluates the whole dataset (no shard, no all-reduce): right number, W times the work."""

TASK = "task4_1"
EXPECT = r"evaluated 11 samples.*whole dataset"


def exact_accuracy(model, dataset, batch_size=32):
    import torch
    from torch.utils.data import DataLoader

    device = next(model.parameters()).device
    correct = total = 0
    with torch.no_grad():
        for inputs, targets in DataLoader(dataset, batch_size=batch_size):
            predicted = model(inputs.to(device)).argmax(dim=1)
            correct += int((predicted == targets.to(device)).sum())
            total += len(targets)
    return correct / total
