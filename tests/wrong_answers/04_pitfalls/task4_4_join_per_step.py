"""Enters Join around each step instead of the whole loop: a rank that ran out never joins."""

TASK = "task4_4"
EXPECT = r"the ranks hung.*Join\(\[model\]\)"


def train_with_join(model, batches, optimizer, loss_fn):
    from torch.distributed.algorithms.join import Join

    steps = 0
    for inputs, targets in batches:
        with Join([model]):
            optimizer.zero_grad()
            loss_fn(model(inputs), targets).backward()
            optimizer.step()
        steps += 1
    return steps
