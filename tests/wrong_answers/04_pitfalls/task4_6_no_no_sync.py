"""Accumulates without no_sync(): every micro-batch's backward all-reduces every gradient."""

TASK = "task4_6"
EXPECT = r"all-reduced every gradient 4 times for 4 micro-batches.*no_sync"


def accumulate_gradients(model, micro_batches, loss_fn):
    k = len(micro_batches)
    for inputs, targets in micro_batches:
        (loss_fn(model(inputs), targets) / k).backward()
