"""Normalises the chosen s + bias as the weights: the bias, meant only to steer the choice,
changes how much each expert's output counts."""

TASK = "task11_7"
EXPECT = r"the bias only chooses the experts"
REPLACE = {"biased_route": [
    ("    chosen = scores.gather(-1, experts)\n",
     "    chosen = (scores + bias).gather(-1, experts)\n"),
]}
