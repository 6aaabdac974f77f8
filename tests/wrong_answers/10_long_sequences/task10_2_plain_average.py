"""Averages the two partial outputs and keeps the larger lse: as if both halves weighed the
same."""

TASK = "task10_2"
EXPECT = r"lse is the larger of the two|plain average"


def merge_partials(out_a, lse_a, out_b, lse_b):
    return (out_a + out_b) / 2, torch.maximum(lse_a, lse_b)
