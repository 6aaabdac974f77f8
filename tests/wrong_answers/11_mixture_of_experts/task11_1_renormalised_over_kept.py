"""Renormalises the weights over the assignments the capacity kept: a token that lost one
expert gives the other all its weight, and the output depends on what else was in the batch."""

TASK = "task11_1"
EXPECT = r"renormalised over the kept experts only"
REPLACE = {"route": [
    ("    kept = (place < capacity).reshape(k, num_tokens).t()\n",
     "    kept = (place < capacity).reshape(k, num_tokens).t()\n"
     "    kept_top = top * kept\n"
     "    weights = kept_top / kept_top.sum(dim=-1, keepdim=True).clamp_min(1e-300)\n"),
]}
