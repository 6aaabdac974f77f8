"""Uses the forward's direction for the backward too: block i's backward starts blocks i + 1,
..., whose backward has already run, so each is all-gathered a second time and the blocks the
backward needs next are not started early."""

TASK = "task5_7"
EXPECT = r"backward's all-gathers were of blocks \[3, 2, 3, 1, 2, 0, 1\]; expected each block once"
REPLACE = {"prefetch": [
    ("list(blocks[max(0, i - backward):i])[::-1]", "list(blocks[i + 1:i + 1 + backward])"),
]}
