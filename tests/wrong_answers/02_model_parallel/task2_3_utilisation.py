"""Returns the busy share m / (m + p - 1) (the utilisation) instead of the idle share."""

TASK = "task2_3"
EXPECT = r"bubble_fraction\(num_stages=1, num_micro_batches=1\) = 1; the simulated schedule is idle 0"


def bubble_fraction(num_stages, num_micro_batches):
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError("need at least one stage and one micro-batch")
    return num_micro_batches / (num_micro_batches + num_stages - 1)
