"""Groups by rank as if experts were dealt round-robin (expert e on rank e % W), not in blocks:
rank 0 gets experts 0 and 2 where it holds 0 and 1."""

TASK = "task11_2"
EXPECT = r"the right assignments in the wrong order"
REPLACE = {"dispatch_plan": [
    ("    order = chosen[torch.argsort(flat_experts[chosen], stable=True)]\n",
     "    dealt = flat_experts[chosen] % world_size * num_experts + flat_experts[chosen]\n"
     "    order = chosen[torch.argsort(dealt, stable=True)]\n"),
]}
