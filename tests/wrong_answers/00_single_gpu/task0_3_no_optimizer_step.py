"""Computes the loss and its gradients but never calls optimizer.step()."""

TASK = "task0_3"
EXPECT = r"parameters did not change.*optimizer\.step\(\)"


def train_step(model, batch, loss_fn, optimizer):
    inputs, targets = batch
    optimizer.zero_grad()
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    return loss.item()
