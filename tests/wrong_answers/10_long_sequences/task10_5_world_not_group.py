"""Counts the passes with the whole world's size, not the group's: in a subgroup every block
goes round more than once and is merged again."""

TASK = "task10_5"
EXPECT = r"with W the group's size"
REPLACE = {"ring_attention": [
    ("    for _ in range(dist.get_world_size(group) - 1):\n",
     "    for _ in range(dist.get_world_size() - 1):\n"),
]}
