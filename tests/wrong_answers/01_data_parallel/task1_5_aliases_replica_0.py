"""Starts the master's gradient as replica 0's tensor and adds into it, changing replica 0 too."""

TASK = "task1_5"
EXPECT = r"replica 0's gradient of '.*' \(the reduction must not change the replicas; did the master's \.grad alias one of them\?\)"


def reduce_gradients_into(master, replicas):
    per_replica = [list(replica.parameters()) for replica in replicas]
    for index, param in enumerate(master.parameters()):
        grads = [params[index].grad for params in per_replica if params[index].grad is not None]
        if not grads:
            continue
        if param.grad is None:
            param.grad = grads[0]
            for grad in grads[1:]:
                param.grad += grad
        else:
            for grad in grads:
                param.grad += grad
