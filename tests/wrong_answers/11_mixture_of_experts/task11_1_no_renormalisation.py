"""Keeps the top-k probabilities as the softmax gave them for every k: with k > 1 a token's
weights then sum to less than 1, and its output shrinks with how unsure the router was."""

TASK = "task11_1"
EXPECT = r"renormalise them after the top-k"
REPLACE = {"route": [
    ("    weights = top / top.sum(dim=-1, keepdim=True) if k > 1 else top\n",
     "    weights = top\n"),
]}
