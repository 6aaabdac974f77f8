"""Renormalises the top-k weights for every k, top-1 included: each weight is then p / p = 1,
and the loss gives the router no gradient (Switch Transformer weighs by p itself)."""

TASK = "task11_1"
EXPECT = r"p / p = 1, and the loss then gives the router no gradient"
REPLACE = {"route": [
    ("    weights = top / top.sum(dim=-1, keepdim=True) if k > 1 else top\n",
     "    weights = top / top.sum(dim=-1, keepdim=True)\n"),
]}
