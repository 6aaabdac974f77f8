"""Averages the replicas' mean losses, which weighs a short last chunk as much as a full one."""

TASK = "task1_6"
EXPECT = r"a plain mean of the chunks' mean losses weighs a short chunk as much as a full one"


def data_parallel_step(model, inputs, targets, loss_fn, num_replicas):
    chunks = scatter(inputs, num_replicas)
    target_chunks = scatter(targets, num_replicas)
    replicas = replicate(model, len(chunks))
    losses = [loss_fn(replica(chunk), target)
              for replica, chunk, target in zip(replicas, chunks, target_chunks, strict=True)]
    loss = torch.stack(losses).mean()
    loss.backward()
    reduce_gradients_into(model, replicas)
    return loss.item()
