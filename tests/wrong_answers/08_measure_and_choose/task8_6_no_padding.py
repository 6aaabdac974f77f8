"""Sends each parameter's own rows: forgets that every rank's piece is padded to
ceil(rows / world_size) rows, so a parameter whose rows do not divide travels larger."""

TASK = "task8_6"
EXPECT = r"ceil\(3 / 4\) = 1 row"
REPLACE = {"fsdp_step_collectives": [
    ("        rows = -(-shape[0] // world_size) * world_size\n",
     "        rows = shape[0]\n"),
]}
