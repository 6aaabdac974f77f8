"""Applies the formula to any p and m, without refusing p < 1 or m < 1."""

TASK = "task2_3"
EXPECT = r"bubble_fraction\(-?\d, -?\d\) (returned|raised) .*expected a ValueError \(a schedule needs p >= 1 and m >= 1\)"


def bubble_fraction(num_stages, num_micro_batches):
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)
