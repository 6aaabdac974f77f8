"""Evaluates in eval mode but without torch.no_grad(), so every forward builds a graph."""

TASK = "task0_4"
EXPECT = r"gradients were enabled in the forward pass; wrap the loop in torch\.no_grad\(\)"


def evaluate(model, loader, loss_fn):
    was_training = model.training
    model.eval()
    loss_sum, seen = 0.0, 0
    for inputs, targets in loader:
        loss_sum += loss_fn(model(inputs), targets).item() * targets.shape[0]
        seen += targets.shape[0]
    model.train(was_training)
    return loss_sum / seen
