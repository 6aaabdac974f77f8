"""Never zeroes the gradients, so every step adds to all the previous steps' gradients."""

TASK = "task3_4"
EXPECT = r"parameter after 2 epochs .* differ"


def train_one_epoch(model, loader, optimizer, loss_fn, epoch):
    import torch
    import torch.distributed as dist

    loader.sampler.set_epoch(epoch)
    device = next(model.parameters()).device
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        totals[0] += loss.detach().double() * len(inputs)
        totals[1] += len(inputs)
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()
