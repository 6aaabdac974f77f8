"""Never clears the gradients, so the previous step's gradients are added to this one's."""

TASK = "task0_3"
EXPECT = r"optimizer\.zero_grad\(\)"


def train_step(model, batch, loss_fn, optimizer):
    inputs, targets = batch
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss.item()
