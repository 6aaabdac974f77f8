"""Holds back p - 1 - s W's on stage s, the first stage most, as if the bubble were at the start
of the step on the first stage (it is at the end)."""

TASK = "task7_6"
EXPECT = r"(A|No) W follows its B \d+: stage s = \d+ holds back its first s W's"
REPLACE = {"zero_bubble": [("if j >= stage:", "if j >= num_stages - 1 - stage:")]}
