"""Gives every master parameter a gradient, zeros where no replica has one, instead of leaving None."""

TASK = "task1_5"
EXPECT = r"'out\.bias' has no gradient on any replica, so the master's must stay None"


def reduce_gradients_into(master, replicas):
    per_replica = [list(replica.parameters()) for replica in replicas]
    for index, param in enumerate(master.parameters()):
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        for params in per_replica:
            if params[index].grad is not None:
                param.grad += params[index].grad
