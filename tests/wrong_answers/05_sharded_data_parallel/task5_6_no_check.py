"""Leaves out the check of every: 0 fails inside range() (with a ValueError by luck), but a
negative spacing wraps nothing and returns as if it had done its work."""

TASK = "task5_6"
EXPECT = r"checkpoint_blocks\(model, every=-1\) returned: raise ValueError"
REPLACE = {"checkpoint_blocks": [
    ("    if every < 1:\n"
     "        raise ValueError(f\"every must be 1 or more (every block, every other, ...), not {every}\")\n",
     ""),
]}
