"""Turns gradients off but never calls model.eval(), so dropout and batch norm stay in training."""

TASK = "task0_4"
EXPECT = r"the model was in training mode; call model\.eval\(\)"


def evaluate(model, loader, loss_fn):
    import torch

    loss_sum, seen = 0.0, 0
    with torch.no_grad():
        for inputs, targets in loader:
            loss_sum += loss_fn(model(inputs), targets).item() * targets.shape[0]
            seen += targets.shape[0]
    return loss_sum / seen
