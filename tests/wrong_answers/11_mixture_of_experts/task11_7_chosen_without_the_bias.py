"""Chooses the top-k of the affinities alone: the bias never steers anything."""

TASK = "task11_7"
EXPECT = r"top-k of the affinities alone"
REPLACE = {"biased_route": [
    ("    experts = (scores.detach() + bias).topk(k, dim=-1).indices",
     "    experts = scores.detach().topk(k, dim=-1).indices"),
]}
