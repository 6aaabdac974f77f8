"""All-reduces the sum and the count over every rank, whatever group it was given."""

TASK = "task10_7"
EXPECT = r"pass group= to the all-reduce"
REPLACE = {"token_mean_loss": [
    ("    dist.all_reduce(totals, group=group)\n", "    dist.all_reduce(totals)\n"),
]}
