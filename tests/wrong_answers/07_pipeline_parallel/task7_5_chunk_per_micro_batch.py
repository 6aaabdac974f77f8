"""Switches chunk at every forward (breadth first: micro-batch 0 through chunk 0, then chunk 1),
not after a round of n micro-batches."""

TASK = "task7_5"
EXPECT = r"Its forwards run the chunks .*a rank stays on a chunk for a round of n"
REPLACE = {"interleaved": [("chunk = chunk_of(step // per_round)", "chunk = chunk_of(step)")]}
