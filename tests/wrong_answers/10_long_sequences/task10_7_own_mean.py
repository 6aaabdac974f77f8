"""Returns this rank's own mean: divides by its own count of real tokens and never
communicates."""

TASK = "task10_7"
EXPECT = r"divided by its own count"
REPLACE = {"token_mean_loss": [
    ("    dist.all_reduce(totals, group=group)\n", ""),
]}
