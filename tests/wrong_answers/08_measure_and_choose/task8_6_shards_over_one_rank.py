"""Accepts a world of one rank, where there is nothing to shard."""

TASK = "task8_6"
EXPECT = r"world_size 1"
REPLACE = {"fsdp_step_collectives": [
    ("    if world_size < 2:\n", "    if world_size < 1:\n"),
]}
