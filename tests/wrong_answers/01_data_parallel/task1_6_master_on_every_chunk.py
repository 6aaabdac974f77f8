"""Runs the master model itself on every chunk: no replicas, and so nothing to reduce."""

TASK = "task1_6"
EXPECT = r"replicas were not used|replica \d was never called"


def data_parallel_step(model, inputs, targets, loss_fn, num_replicas):
    chunks = scatter(inputs, num_replicas)
    outputs = [model(chunk) for chunk in chunks]
    loss = loss_fn(gather(outputs), targets)
    loss.backward()
    return loss.item()
