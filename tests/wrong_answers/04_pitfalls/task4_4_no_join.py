"""Trains without Join: the rank with more batches waits forever for the one that stopped."""

TASK = "task4_4"
EXPECT = r"the ranks hung.*Join\(\[model\]\)"


def train_with_join(model, batches, optimizer, loss_fn):
    steps = 0
    for inputs, targets in batches:
        optimizer.zero_grad()
        loss_fn(model(inputs), targets).backward()
        optimizer.step()
        steps += 1
    return steps
