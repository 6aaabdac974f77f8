"""Returns the model itself num_replicas times ([model] * n) instead of copies."""

TASK = "task1_3"
EXPECT = r"replica 0 is the model itself"


def replicate(model, num_replicas):
    return [model] * num_replicas
