"""Plans every assignment, dropped or not: the expert's rank receives tokens over capacity."""

TASK = "task11_2"
EXPECT = r"counts the dropped assignments too"
REPLACE = {"dispatch_plan": [
    ("    chosen = flat_kept.nonzero().flatten()\n",
     "    chosen = torch.arange(flat_kept.numel())\n"),
]}
