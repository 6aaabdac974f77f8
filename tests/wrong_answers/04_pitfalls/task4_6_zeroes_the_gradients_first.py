"""Zeroes the gradients before accumulating: what the caller had accumulated is lost."""

TASK = "task4_6"
EXPECT = r"what the caller had accumulated before .* is gone\. Do not zero the gradients"


def accumulate_gradients(model, micro_batches, loss_fn):
    import contextlib

    model.zero_grad(set_to_none=True)
    k = len(micro_batches)
    for index, (inputs, targets) in enumerate(micro_batches):
        last = index == k - 1
        with contextlib.nullcontext() if last else model.no_sync():
            (loss_fn(model(inputs), targets) / k).backward()
