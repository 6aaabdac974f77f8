"""Copies each replica's gradient into the master in turn, so only the last replica's survives."""

TASK = "task1_5"
EXPECT = r"only replica 2's gradient"


def reduce_gradients_into(master, replicas):
    for replica in replicas:
        for param, replica_param in zip(master.parameters(), replica.parameters(), strict=True):
            if replica_param.grad is not None:
                param.grad = replica_param.grad.clone()
