"""Deep-copies the model once and hands the same copy to every replica."""

TASK = "task1_3"
EXPECT = r"replica 1 is the same object as replica 0|replica 1's '0\.weight' shares memory with replica 0's"


def replicate(model, num_replicas):
    replica = copy.deepcopy(model)
    replica.zero_grad(set_to_none=True)
    return [replica] * num_replicas
