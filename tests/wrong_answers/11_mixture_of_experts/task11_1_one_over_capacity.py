"""Keeps an expert's first capacity + 1 assignments: the place in the queue counted from 1."""

TASK = "task11_1"
EXPECT = r"keeps capacity \+ 1 per expert"
REPLACE = {"route": [
    ("    kept = (place < capacity).reshape(k, num_tokens).t()\n",
     "    kept = (place <= capacity).reshape(k, num_tokens).t()\n"),
]}
