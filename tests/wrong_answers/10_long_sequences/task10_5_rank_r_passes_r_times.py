"""Rank r passes the ring r times (its place, not the group's size): rank 1 waits in its pass
for rank 0, which never makes one, and the ring hangs until the group's timeout."""

TASK = "task10_5"
EXPECT = r"every rank of the group must make the same number of\s+passes"
REPLACE = {"ring_attention": [
    ("    for _ in range(dist.get_world_size(group) - 1):\n",
     "    for _ in range(dist.get_rank(group)):\n"),
]}
