"""Slices the forward list from the block itself (blocks[i:i + forward]): a block is gathered
before its forward anyway, so one block fewer is started ahead than asked."""

TASK = "task5_7"
EXPECT = r"when block 0's forward began, blocks \[0\] had been all-gathered; expected \[0, 1\]"
REPLACE = {"prefetch": [
    ("list(blocks[i + 1:i + 1 + forward])", "list(blocks[i:i + forward])"),
]}
