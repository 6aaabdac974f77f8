"""Takes an MLP weight as the largest parameter, though the embeddings and the head may be."""

TASK = "task5_10"
EXPECT = r"P as an MLP weight"
REPLACE = {"zero_peak_bytes": [("largest = max(4 * C * C, V * C, T * C)",
                                "largest = 4 * C * C")]}
