"""Compares sends and receives too: a send on one rank and the matching receive on the other
look like two different collectives under one sequence id."""

TASK = "task9_4"
EXPECT = r"sends and receives, numbered"
REPLACE = {"first_mismatch": [
    ('            operation = entry["profiling_name"].split(":", 1)[-1].split(" ")[0]\n'
     '            if operation in ("send", "recv"):  # point-to-point: numbered apart\n'
     '                continue\n',
     ''),
]}
