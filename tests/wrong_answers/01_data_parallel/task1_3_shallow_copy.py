"""Makes replicas with copy.copy, which shares the model's parameters instead of copying them."""

TASK = "task1_3"
EXPECT = r"replica 0's '0\.weight' shares memory with the model's '0\.weight'.*copy\.deepcopy"


def replicate(model, num_replicas):
    replicas = []
    for _ in range(num_replicas):
        replica = copy.copy(model)
        replicas.append(replica)
    return replicas
