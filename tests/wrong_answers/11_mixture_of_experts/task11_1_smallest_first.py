"""Takes the top-k, then sorts the chosen experts by their number: the right experts, but the
first choice is no longer the most likely one, and the capacity serves the wrong ones first."""

TASK = "task11_1"
EXPECT = r"the right experts in the wrong order; largest probability first"
REPLACE = {"route": [
    ("    top, experts = probs.topk(k, dim=-1)\n",
     "    top, experts = probs.topk(k, dim=-1)\n"
     "    experts, sorting = experts.sort(dim=-1)\n"
     "    top = top.gather(-1, sorting)\n"),
]}
