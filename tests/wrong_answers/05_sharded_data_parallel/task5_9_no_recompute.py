"""Leaves out the block that checkpointing recomputes in the backward: a checkpointed model's
peak taken as its kept inputs alone."""

TASK = "task5_9"
EXPECT = r"no recomputed block: with checkpointing the backward recomputes one block whole"
REPLACE = {"peak_bytes": [("recompute = tokens * (16 * C + H + 4 + V) + gradient if checkpoint "
                           "else 0", "recompute = 0")]}
