"""Sums each token's k expert outputs without their gate weights."""

TASK = "task11_6"
EXPECT = r"without their gate weights"
REPLACE = {"grouped_experts": [
    ("    return (per_assignment.view(*experts.shape, -1) * weights.unsqueeze(-1)).sum(dim=1)",
     "    return per_assignment.view(*experts.shape, -1).sum(dim=1)"),
]}
