"""Takes the default with `scale or ...`: an explicit scale=0.0 is falsy and is replaced by
1/sqrt(head_dim)."""

TASK = "task10_3"
EXPECT = r"scale=0.0 was replaced by the default"
REPLACE = {"attend_block": [
    ("    scale = q.shape[-1] ** -0.5 if scale is None else scale\n",
     "    scale = scale or q.shape[-1] ** -0.5\n"),
]}
