"""Never checks the number of stages: more stages than layers gives an empty cut."""

TASK = "task7_8"
EXPECT = r"raise ValueError, \d+ layers cannot make \d+ stages|balance_by_time\(\[.*\], -?\d+\) raised"
REPLACE = {"balance_by_time": [("if not 1 <= num_stages <= n:", "if False:")]}
