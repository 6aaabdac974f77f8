"""Computes every block, also those whose keys all come after every query of this rank: right
numbers, wasted scores."""

TASK = "task10_5"
EXPECT = r"Skip a block whose keys all come after"
REPLACE = {"ring_attention": [
    ("        if causal and k_positions.min() > positions.max():\n"
     "            continue  # every key of the block comes after every query of this rank\n",
     ""),
]}
