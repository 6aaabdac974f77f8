"""Leaves the heads unchecked: 3 heads on 2 ranks fail inside the exchange, with a message about
dimension 1 that never mentions heads."""

TASK = "task10_6"
EXPECT = r"should say that the heads"
REPLACE = {"ulysses_attention": [
    ("    if q.shape[1] % world:\n", "    if False:\n"),
]}
