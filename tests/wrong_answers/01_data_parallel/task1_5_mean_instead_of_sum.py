"""Averages the replicas' gradients instead of summing them into the master."""

TASK = "task1_5"
EXPECT = r"mean of the 3 replicas' gradients.*sum"


def reduce_gradients_into(master, replicas):
    per_replica = [list(replica.parameters()) for replica in replicas]
    for index, param in enumerate(master.parameters()):
        grads = [params[index].grad for params in per_replica if params[index].grad is not None]
        if not grads:
            continue
        total = torch.stack(grads).mean(dim=0)
        if param.grad is None:
            param.grad = total
        else:
            param.grad += total
