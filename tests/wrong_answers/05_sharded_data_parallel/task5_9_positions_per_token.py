"""Counts the positions once per token, as if every sequence kept its own (the batch shares
them: one per position)."""

TASK = "task5_9"
EXPECT = r"off by the positions"
REPLACE = {"activation_bytes": [("8 * (2 * tokens + T)", "8 * 3 * tokens")]}
