"""Counts ZeRO-2's reduce-scatter as ZeRO-1's, without the whole gradient its hook holds."""

TASK = "task5_10"
EXPECT = r"R without the whole gradient"
REPLACE = {"zero_peak_bytes": [
    ("reduce_scatter = padded_and_pieces + (largest if stage == 2 else 0)",
     "reduce_scatter = padded_and_pieces")]}
