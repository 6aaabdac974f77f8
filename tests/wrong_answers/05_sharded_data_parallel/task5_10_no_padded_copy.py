"""Counts a reduce-scatter as its two pieces, forgetting the padded copy of the gradient."""

TASK = "task5_10"
EXPECT = r"R without the padded copy"
REPLACE = {"zero_peak_bytes": [
    ("padded_and_pieces = (world_size + 2) * shard_size(largest, world_size)",
     "padded_and_pieces = 2 * shard_size(largest, world_size)")]}
