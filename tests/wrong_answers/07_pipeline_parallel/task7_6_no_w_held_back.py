"""Runs each W straight after its B on every stage: 1F1B with the backward split, which leaves
the bubble at the end of the step empty."""

TASK = "task7_6"
EXPECT = r"A W follows its B \d+: stage s = \d+ holds back its first s W's"
REPLACE = {"zero_bubble": [("if j >= stage:", "if True:")]}
