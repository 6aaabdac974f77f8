"""Keeps the last of the tied cuts (<= where < is meant): more layers in the first stages."""

TASK = "task7_8"
EXPECT = r"the tie goes to the fewest layers in the first stage"
REPLACE = {"balance_by_time": [("if best is None or slowest < best[0]:",
                                "if best is None or slowest <= best[0]:")]}
