"""Exchanges over every rank whatever group it was given: the blocks of experts are those of a
world of 4, not of the group's 2."""

TASK = "task11_4"
EXPECT = r"raised ValueError in a group of 2 of 4 ranks"
REPLACE = {"expert_parallel_forward": [
    ("    world = dist.get_world_size(group)\n", "    world = dist.get_world_size()\n"),
]}
