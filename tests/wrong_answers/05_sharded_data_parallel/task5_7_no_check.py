"""Leaves out the check of the distances: a negative forward slices from the end of the list
(blocks[i + 1:i]) and prefetches nothing, silently; on blocks not yet sharded it fails deep in
the loop instead of saying what is wrong."""

TASK = "task5_7"
EXPECT = r"prefetch\(blocks, forward=-1, backward=1\) raised AttributeError.*raise ValueError"
REPLACE = {"prefetch": [
    ("    if forward < 0 or backward < 0:\n"
     "        raise ValueError(f\"forward and backward count blocks to start ahead, 0 or more, not \"\n"
     "                         f\"forward={forward}, backward={backward}\")\n", ""),
]}
