"""Counts "every other block" from block 0: wraps blocks 0, every, 2 every, ... (0 and 2 of
four for every=2) where the every-th block is block every - 1, and wraps block 0 even when
every passes the last block."""

TASK = "task5_6"
EXPECT = r"blocks \[1, 3\] should run theirs again in the backward.*\[0, 2\] were replaced"
REPLACE = {"checkpoint_blocks": [
    ("    for index in range(every - 1, len(model.blocks), every):  # the every-th, ...\n",
     "    for index in range(0, len(model.blocks), every):\n"),
]}
