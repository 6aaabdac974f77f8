"""Returns this rank's own mean loss: the loss sums are never all-reduced."""

TASK = "task3_4"
EXPECT = r"the ranks returned different losses.*all_reduce"


def train_one_epoch(model, loader, optimizer, loss_fn, epoch):
    import torch

    loader.sampler.set_epoch(epoch)
    device = next(model.parameters()).device
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        totals[0] += loss.detach().double() * len(inputs)
        totals[1] += len(inputs)
    return (totals[0] / totals[1]).item()
