"""Weighs each token's row by its gate weight before the expert runs: the weight goes through
the gelu, and the output is no longer weight x expert(token)."""

TASK = "task11_6"
EXPECT = r"weighs each token before its expert runs"
REPLACE = {"grouped_experts": [
    ("    x = x.index_copy(0, rows, tokens[order // k])\n",
     "    x = x.index_copy(0, rows, tokens[order // k] * weights.reshape(-1)[order, None])\n"),
    ("    return (per_assignment.view(*experts.shape, -1) * weights.unsqueeze(-1)).sum(dim=1)",
     "    return per_assignment.view(*experts.shape, -1).sum(dim=1)"),
]}
