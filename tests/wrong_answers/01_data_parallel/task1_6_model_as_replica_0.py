"""Uses the model itself as replica 0 and copies only for the others, so replica 0's gradient is counted twice."""

TASK = "task1_6"
EXPECT = r"the model itself ran|replicas were not used"


def data_parallel_step(model, inputs, targets, loss_fn, num_replicas):
    chunks = scatter(inputs, num_replicas)
    replicas = [model] + replicate(model, len(chunks) - 1)
    outputs = [replica(chunk) for replica, chunk in zip(replicas, chunks, strict=True)]
    loss = loss_fn(gather(outputs), targets)
    loss.backward()
    reduce_gradients_into(model, replicas)
    return loss.item()
