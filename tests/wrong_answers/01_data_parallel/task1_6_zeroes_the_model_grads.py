"""Clears the model's gradients first, so the gradients already there are lost (backward adds)."""

TASK = "task1_6"
EXPECT = r"with gradients already there \(backward adds to them\)"


def data_parallel_step(model, inputs, targets, loss_fn, num_replicas):
    model.zero_grad(set_to_none=True)
    chunks = scatter(inputs, num_replicas)
    replicas = replicate(model, len(chunks))
    outputs = [replica(chunk) for replica, chunk in zip(replicas, chunks, strict=True)]
    loss = loss_fn(gather(outputs), targets)
    loss.backward()
    reduce_gradients_into(model, replicas)
    return loss.item()
