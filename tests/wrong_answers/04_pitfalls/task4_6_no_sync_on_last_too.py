"""Runs every micro-batch inside no_sync(), the last one too: nothing is ever all-reduced."""

TASK = "task4_6"
EXPECT = r"no gradient was all-reduced.*last micro-batch.*outside"


def accumulate_gradients(model, micro_batches, loss_fn):
    k = len(micro_batches)
    with model.no_sync():
        for inputs, targets in micro_batches:
            (loss_fn(model(inputs), targets) / k).backward()
