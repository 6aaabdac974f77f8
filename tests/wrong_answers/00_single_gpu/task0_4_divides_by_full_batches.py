"""Weighs each batch by its size but divides by len(loader) * batch_size, as if every batch were full."""

TASK = "task0_4"
EXPECT = r"divided by 12.*10 samples"


def evaluate(model, loader, loss_fn):
    import torch

    was_training = model.training
    model.eval()
    loss_sum = 0.0
    with torch.no_grad():
        for inputs, targets in loader:
            loss_sum += loss_fn(model(inputs), targets).item() * targets.shape[0]
    model.train(was_training)
    return loss_sum / (len(loader) * loader.batch_size)
