"""Calls model.train() at the end, even when the model was in eval mode before evaluate."""

TASK = "task0_4"
EXPECT = r"in eval mode before evaluate and in training mode after; restore the mode it had"


def evaluate(model, loader, loss_fn):
    import torch

    model.eval()
    loss_sum, seen = 0.0, 0
    with torch.no_grad():
        for inputs, targets in loader:
            loss_sum += loss_fn(model(inputs), targets).item() * targets.shape[0]
            seen += targets.shape[0]
    model.train()
    return loss_sum / seen
