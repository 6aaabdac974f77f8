"""Adds up the durations of each kind's events: a backward event nested in another, or two
all-reduces running at once on gloo's two threads, are counted twice."""

TASK = "task8_5"
EXPECT = r"union of its intervals"
REPLACE = {"read_step": [
    ('            "backward_us": sum(b - a for a, b in backward),\n'
     '            "comm_us": sum(b - a for a, b in communication),\n',
     '            "backward_us": sum(b - a for a, b in kinds["backward"]),\n'
     '            "comm_us": sum(b - a for a, b in kinds["comm"]),\n'),
]}
