"""Divides by the number of ranks in the world instead of in ``group``: right while the group is
every rank, wrong for two groups training side by side."""

TASK = "task11_5"
EXPECT = r"rank 0: two groups of ep 2, case 0: replicated parameter 0's gradient .*divided by every rank's count"
REPLACE = {"sync_gradients": [
    ("    world = dist.get_world_size(group)", "    world = dist.get_world_size()"),
]}
