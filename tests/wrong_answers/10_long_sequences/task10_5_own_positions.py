"""Passes the keys and values around but masks every block with this rank's own positions, as
if each block were its own."""

TASK = "task10_5"
EXPECT = r"ring_attention's out"
REPLACE = {"ring_attention": [
    ("        part = attend_block(q, k_block, v_block, positions, k_positions, causal)\n",
     "        part = attend_block(q, k_block, v_block, positions, positions, causal)\n"),
]}
