"""Keeps the kept assignments in token order: rank 0's rows and rank 1's interleave, and the
all-to-all sends each rank the wrong rows."""

TASK = "task11_2"
EXPECT = r"the right assignments in the wrong order"
REPLACE = {"dispatch_plan": [
    ("    order = chosen[torch.argsort(flat_experts[chosen], stable=True)]\n",
     "    order = chosen\n"),
]}
