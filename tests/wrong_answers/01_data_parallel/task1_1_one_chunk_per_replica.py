"""Always returns num_replicas sizes, padding with empty chunks (5 on 4 as [2, 2, 1, 0])."""

TASK = "task1_1"
EXPECT = r"scatter_sizes\(5, 4\) returned \[2, 2, 1, 0\].*devices left over get no chunk at all"


def scatter_sizes(batch_size, num_replicas):
    per_chunk = -(-batch_size // num_replicas)
    sizes = []
    left = batch_size
    for _ in range(num_replicas):
        sizes.append(min(per_chunk, left))
        left -= sizes[-1]
    return sizes
