"""Gives rank r chunks r and W + r: every rank gets two chunks, but the last rank's are both
late in the sequence."""

TASK = "task10_4"
EXPECT = r"chunks r and W\+r"
REPLACE = {"zigzag_split": [
    ("pieces[chunks - 1 - r]", "pieces[world_size + r]"),
]}
