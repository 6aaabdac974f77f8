"""Forgets the default scale: the scores are q·k, not q·k / sqrt(head_dim)."""

TASK = "task10_3"
EXPECT = r"not scaled"
REPLACE = {"attend_block": [
    ("    scale = q.shape[-1] ** -0.5 if scale is None else scale\n",
     "    scale = 1.0 if scale is None else scale\n"),
]}
