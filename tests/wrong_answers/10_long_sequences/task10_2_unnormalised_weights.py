"""Weighs each output by exp(lse - max) without dividing by their sum: the weights do not add
up to one."""

TASK = "task10_2"
EXPECT = r"merge_partials' out"
REPLACE = {"merge_partials": [
    ("    out = (torch.exp(lse_a - lse).unsqueeze(-1) * out_a\n"
     "           + torch.exp(lse_b - lse).unsqueeze(-1) * out_b)\n",
     "    out = (torch.exp(lse_a - top).unsqueeze(-1) * out_a\n"
     "           + torch.exp(lse_b - top).unsqueeze(-1) * out_b)\n"),
]}
