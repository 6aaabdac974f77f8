"""Outputs right, but divides by a sum that is 0 on a row that sees nothing (then replaces the
NaN): the forward is fine, the gradient is NaN."""

TASK = "task10_3"
EXPECT = r"NaN or inf"
REPLACE = {"attend_block": [
    ("    out = (weights @ v) / torch.where(seen, total, torch.ones_like(total))\n",
     "    out = torch.nan_to_num((weights @ v) / total)\n"),
]}
