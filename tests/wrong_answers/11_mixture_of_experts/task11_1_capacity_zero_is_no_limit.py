"""Reads capacity 0 as no limit (`if not capacity`): an expert with capacity 0 keeps every
assignment instead of none."""

TASK = "task11_1"
EXPECT = r"capacity 0 kept every assignment, as if 0 meant no limit"
REPLACE = {"route": [
    ("    if capacity is None:\n        return experts, weights,",
     "    if not capacity:\n        return experts, weights,"),
]}
