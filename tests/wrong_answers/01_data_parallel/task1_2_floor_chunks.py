"""Splits into pieces of batch_size // num_replicas, which leaves an extra chunk for the remainder."""

TASK = "task1_2"
EXPECT = r"scatter\(a batch of 10, 3\) gave 4 chunks .*DataParallel makes 3 chunks of sizes \[4, 4, 2\]"


def scatter(batch, num_replicas):
    return list(batch.split(max(1, batch.shape[0] // num_replicas), dim=0))
