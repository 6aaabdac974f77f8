"""Splits with floor division and gives the remainder to the last replica."""

TASK = "task1_1"
EXPECT = r"chunk"


def scatter_sizes(batch_size, num_replicas):
    base = batch_size // num_replicas
    sizes = [base] * num_replicas
    sizes[-1] += batch_size - base * num_replicas
    return sizes
