"""Warms up with 2 (p - s - 1) forwards, interleaved 1F1B's count, where ZB-H1 keeps 1F1B's."""

TASK = "task7_6"
EXPECT = r"forwards before its first B, torch \d+: the warm-up is min\(p - s - 1, m\)"
REPLACE = {"zero_bubble": [("warmup = min(num_stages - stage - 1, num_micro_batches)",
                            "warmup = min(2 * (num_stages - stage - 1), num_micro_batches)")]}
