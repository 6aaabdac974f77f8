"""Keeps an expert's first capacity + 1 assignments: the place in the queue counted from 1."""

TASK = "task11_1"
EXPECT = r"keeps \d+ per expert; an expert takes at most capacity"
REPLACE = {"route": [
    ("    kept = (place < capacity).reshape(k, num_tokens).t()\n",
     "    kept = (place <= capacity).reshape(k, num_tokens).t()\n"),
]}
