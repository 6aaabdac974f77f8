"""Uses the large-m approximation (p - 1) / m as if it were the exact bubble fraction."""

TASK = "task2_3"
EXPECT = r"bubble_fraction\(num_stages=\d, num_micro_batches=\d+\) = .*the simulated schedule is idle"


def bubble_fraction(num_stages, num_micro_batches):
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError("need at least one stage and one micro-batch")
    return (num_stages - 1) / num_micro_batches
