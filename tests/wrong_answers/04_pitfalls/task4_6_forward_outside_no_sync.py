"""Wraps only backward() in no_sync(), the forward outside it: DDP still all-reduces every time."""

TASK = "task4_6"
EXPECT = r"forward ran outside no_sync\(\): DDP armed the all-reduce in forward"


def accumulate_gradients(model, micro_batches, loss_fn):
    import contextlib

    k = len(micro_batches)
    for index, (inputs, targets) in enumerate(micro_batches):
        loss = loss_fn(model(inputs), targets) / k
        with contextlib.nullcontext() if index == k - 1 else model.no_sync():
            loss.backward()
