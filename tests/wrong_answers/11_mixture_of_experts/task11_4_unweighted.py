"""Sums a token's expert outputs without their gate weights: the router then gets no gradient
from the loss, and the output is too large (with top-1, by 1 / p)."""

TASK = "task11_4"
EXPECT = r"the sum of the experts' outputs unweighted|no gradient reached the weights"
REPLACE = {"expert_parallel_forward": [
    ("    return (slots.view(*experts.shape, returned.shape[-1]) * weights.unsqueeze(-1))"
     ".sum(dim=1)",
     "    return slots.view(*experts.shape, returned.shape[-1]).sum(dim=1)"),
]}
