"""Counts one rank's piece as the payload: an all-gather's payload is its output, the gathered
whole, and a reduce-scatter's its input."""

TASK = "task8_6"
EXPECT = r"gathered whole"
REPLACE = {"fsdp_step_collectives": [
    ("        rows = -(-shape[0] // world_size) * world_size\n",
     "        rows = -(-shape[0] // world_size)\n"),
]}
