"""Lets the root free its parameters after the forward like every unit, and so gather them a
second time: torch keeps the root's, since its backward runs first."""

TASK = "task8_6"
EXPECT = r"keeps the root's parameters"
REPLACE = {"fsdp_step_collectives": [
    ("        gathers = 2 if reshard_after_forward and not is_root else 1\n",
     "        gathers = 2 if reshard_after_forward else 1\n"),
]}
