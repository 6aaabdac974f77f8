"""Holds memory_per_rank's whole total through the step, gradients included, as under DDP."""

TASK = "task5_10"
EXPECT = r"the gradients held through the whole step"
REPLACE = {"zero_peak_bytes": [("return held + max(start, end)",
                                "return held + memory[\"gradients\"] + start")]}
