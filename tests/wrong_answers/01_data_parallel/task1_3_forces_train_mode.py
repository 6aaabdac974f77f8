"""Calls .train() on every replica ("replicas are for training"), even when the model is in eval mode."""

TASK = "task1_3"
EXPECT = r"replica 0 has training=True, the model False: a replica runs in the model's mode"


def replicate(model, num_replicas):
    replicas = []
    for _ in range(num_replicas):
        replica = copy.deepcopy(model).train()
        replica.zero_grad(set_to_none=True)
        replicas.append(replica)
    return replicas
