"""Assigns the sum to master's .grad, overwriting the gradient already there instead of adding."""

TASK = "task1_5"
EXPECT = r"overwr.*add"


def reduce_gradients_into(master, replicas):
    per_replica = [list(replica.parameters()) for replica in replicas]
    for index, param in enumerate(master.parameters()):
        grads = [params[index].grad for params in per_replica if params[index].grad is not None]
        if grads:
            param.grad = torch.stack(grads).sum(dim=0)
