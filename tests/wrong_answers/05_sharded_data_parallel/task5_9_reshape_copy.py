"""Counts the attention's output twice: its transposed reshape taken as a copy (it is a view)."""

TASK = "task5_9"
EXPECT = r"off by 32 floats per token in each block: a block's C"
REPLACE = {"activation_bytes": [("per_block = C if checkpoint else 16 * C + H + 4",
                                 "per_block = C if checkpoint else 17 * C + H + 4")]}
