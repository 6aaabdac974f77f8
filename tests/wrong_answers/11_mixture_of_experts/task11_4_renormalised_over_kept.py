"""Renormalises the weights over the assignments the capacity kept: a token that lost an
expert gives the other all its weight, and with top-1 every weight becomes p / p = 1."""

TASK = "task11_4"
EXPECT = r"those weights are renormalised over the kept assignments"
REPLACE = {"expert_parallel_forward": [
    ("    return (slots.view(*experts.shape, returned.shape[-1]) * weights.unsqueeze(-1))"
     ".sum(dim=1)",
     "    weights = weights * kept / (weights * kept).sum(dim=-1, keepdim=True).clamp_min(1e-30)\n"
     "    return (slots.view(*experts.shape, returned.shape[-1]) * weights.unsqueeze(-1))"
     ".sum(dim=1)"),
]}
