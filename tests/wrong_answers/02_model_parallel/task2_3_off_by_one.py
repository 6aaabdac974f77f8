"""Counts the forward phase as m + p steps instead of m + p - 1: (p - 1) / (m + p)."""

TASK = "task2_3"
EXPECT = r"bubble_fraction\(num_stages=2, num_micro_batches=1\) = 0\.333333; the simulated schedule is idle 0\.5"


def bubble_fraction(num_stages, num_micro_batches):
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError("need at least one stage and one micro-batch")
    return (num_stages - 1) / (num_micro_batches + num_stages)
