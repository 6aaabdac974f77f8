"""Adds up every replica's .grad without skipping parameters whose gradient is None."""

TASK = "task1_5"
EXPECT = r"'out\.bias'.*None.*skip"


def reduce_gradients_into(master, replicas):
    per_replica = [list(replica.parameters()) for replica in replicas]
    for index, param in enumerate(master.parameters()):
        total = sum(params[index].grad for params in per_replica)
        if param.grad is None:
            param.grad = total
        else:
            param.grad += total
