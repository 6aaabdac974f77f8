"""Reduces the replicas' gradients into the model before the backward has computed them."""

TASK = "task1_6"
EXPECT = r"no gradient after data_parallel_step .*: the replicas' gradients must be summed back into the model"


def data_parallel_step(model, inputs, targets, loss_fn, num_replicas):
    chunks = scatter(inputs, num_replicas)
    replicas = replicate(model, len(chunks))
    outputs = [replica(chunk) for replica, chunk in zip(replicas, chunks, strict=True)]
    loss = loss_fn(gather(outputs), targets)
    reduce_gradients_into(model, replicas)
    loss.backward()
    return loss.item()
