"""Takes every round to be p micro-batches, as Megatron-LM requires, where torch makes
max(1, m // p) rounds of m / rounds (m < p: one round of m; m = 10 on 4 ranks: two of 5)."""

TASK = "task7_5"
EXPECT = r"n = \d+ micro-batches per round|the rule is chunk \(i // n\) % v, n = \d+"
REPLACE = {"interleaved": [("per_round = num_micro_batches // rounds", "per_round = num_ranks")]}
