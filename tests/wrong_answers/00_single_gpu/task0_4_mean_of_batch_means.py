"""Averages the per-batch mean losses, so the short last batch weighs as much as a full one."""

TASK = "task0_4"
EXPECT = r"the mean of the 3 per-batch means.*weigh each batch's mean loss by its number"


def evaluate(model, loader, loss_fn):
    import torch

    was_training = model.training
    model.eval()
    losses = []
    with torch.no_grad():
        for inputs, targets in loader:
            losses.append(loss_fn(model(inputs), targets).item())
    model.train(was_training)
    return sum(losses) / len(losses)
