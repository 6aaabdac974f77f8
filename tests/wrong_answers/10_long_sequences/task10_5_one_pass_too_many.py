"""Passes W times: the last pass sends each block back to where it started, for nothing."""

TASK = "task10_5"
EXPECT = r"called ring_pass 2 time|W-th sends each block back"
REPLACE = {"ring_attention": [
    ("    for _ in range(dist.get_world_size(group) - 1):\n"
     "        block = ring_pass(block, group)\n",
     "    for _ in range(dist.get_world_size(group) - 1):\n"
     "        block = ring_pass(block, group)\n"
     "        if _ == dist.get_world_size(group) - 2:\n"
     "            ring_pass(block, group)\n"),
]}
