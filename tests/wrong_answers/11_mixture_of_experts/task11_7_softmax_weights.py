"""Weighs the chosen experts by a softmax over their logits (Mixtral's form) instead of the
chosen sigmoid affinities normalised."""

TASK = "task11_7"
EXPECT = r"softmax over the chosen logits"
REPLACE = {"biased_route": [
    ("    return experts, chosen / chosen.sum(dim=-1, keepdim=True)",
     "    return experts, logits.gather(-1, experts).softmax(dim=-1)"),
]}
