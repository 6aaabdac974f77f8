"""Trusts k: k larger than the number of experts fails inside topk with torch's own error."""

TASK = "task11_1"
EXPECT = r"DID NOT RAISE|selected index k out of range|ValueError"
REPLACE = {"route": [
    ("    if not 1 <= k <= num_experts:\n"
     "        raise ValueError(f\"k = {k}: choose 1 to {num_experts} of the {num_experts} "
     "experts\")\n", ""),
]}
