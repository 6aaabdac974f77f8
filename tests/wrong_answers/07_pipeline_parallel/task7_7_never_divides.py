"""Sums the copies' gradients and never divides."""

TASK = "task7_7"
EXPECT = r"summed over the copies but not divided by their number"
REPLACE = {"average_over_copies": [("parameter.grad /= copies.size()", "pass")]}
