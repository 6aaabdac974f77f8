"""Accumulates with no_sync but never divides the loss by k: the gradient is k times too big."""

TASK = "task4_6"
EXPECT = r"accumulated gradient vs one process on the full batch \(divide each micro-batch loss by k\).* differ"


def accumulate_gradients(model, micro_batches, loss_fn):
    import contextlib

    k = len(micro_batches)
    for index, (inputs, targets) in enumerate(micro_batches):
        with contextlib.nullcontext() if index == k - 1 else model.no_sync():
            loss_fn(model(inputs), targets).backward()
