"""Ignores every and wraps all the blocks: the memory of full checkpointing, and the compute of
recomputing every block, where selective checkpointing was asked for."""

TASK = "task5_6"
EXPECT = r"the blocks ran \[2, 2, 2, 2\] forwards in a step; blocks \[1, 3\] should run theirs again"
REPLACE = {"checkpoint_blocks": [
    ("    for index in range(every - 1, len(model.blocks), every):  # the every-th, ...\n",
     "    for index in range(len(model.blocks)):\n"),
]}
