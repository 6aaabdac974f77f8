"""Runs the W's left at the end newest first, as GPipe's backwards go."""

TASK = "task7_6"
EXPECT = r"each W is the oldest that has not run|W's left at the end run last, oldest first"
REPLACE = {"zero_bubble": [("actions += [(\"W\", i) for i in range(weights, num_micro_batches)]",
                            "actions += [(\"W\", i) for i in reversed(range(weights, "
                            "num_micro_batches))]")]}
