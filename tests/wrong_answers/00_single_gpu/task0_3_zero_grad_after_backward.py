"""Calls optimizer.zero_grad() between backward and step, wiping the gradients it just computed."""

TASK = "task0_3"
EXPECT = r"parameters did not change.*zero_grad"


def train_step(model, batch, loss_fn, optimizer):
    inputs, targets = batch
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    optimizer.zero_grad()
    optimizer.step()
    return loss.item()
