"""Gives each block its backward list in the forward's order, farthest first (blocks i - 2,
i - 1 for backward=2): FSDP starts them in the list's order, so the block needed next waits
behind one needed later."""

TASK = "task5_7"
EXPECT = r"the backward's all-gathers were of blocks \[3, 1, 2, 0\]; expected .*nearest first"
REPLACE = {"prefetch": [
    ("list(blocks[max(0, i - backward):i])[::-1]", "list(blocks[max(0, i - backward):i])"),
]}
