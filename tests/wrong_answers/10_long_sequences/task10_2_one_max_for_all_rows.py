"""Subtracts one maximum for every row instead of each row's own: rows whose lse are far apart
underflow: exp(-1000) is 0, and log(0) is -inf."""

TASK = "task10_2"
EXPECT = r"underflows .*subtract each row's larger lse"
REPLACE = {"merge_partials": [
    ("    top = torch.maximum(lse_a, lse_b)  # finite: one side at least saw a key\n",
     "    top = torch.maximum(lse_a.max(), lse_b.max())\n"),
]}
