"""Exchanges over every rank whatever group it was given: the blocks of experts are those of a
world of 4, not of the group's 2."""

TASK = "task11_4"
EXPECT = r"subgroups|group|4 experts on"
REPLACE = {"expert_parallel_forward": [
    ("    world = dist.get_world_size(group)\n", "    world = dist.get_world_size()\n"),
]}
