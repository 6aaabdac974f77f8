"""Warms up as 1F1B does, one forward per rank after it (p - 1 - r), not two: a chunk's backward
comes back over twice the hops."""

TASK = "task7_5"
EXPECT = r"forwards before its first backward, torch \d+: the warm-up is"
REPLACE = {"interleaved": [("+ 2 * (num_ranks - 1 - rank)", "+ (num_ranks - 1 - rank)")]}
