"""Returns the loss tensor itself instead of loss.item()."""

TASK = "task0_3"
EXPECT = r"returned a Tensor, expected a Python float"


def train_step(model, batch, loss_fn, optimizer):
    inputs, targets = batch
    optimizer.zero_grad()
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss
