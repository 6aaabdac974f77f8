"""Adds up, all-reduce by all-reduce, the part the backward does not hide: where two
all-reduces run at once, that time is exposed twice."""

TASK = "task8_5"
EXPECT = r"exposed_comm_us is"
REPLACE = {"read_step": [
    ('            "exposed_comm_us": sum(b - a - covered(a, b, backward) for a, b in communication),\n',
     '            "exposed_comm_us": sum(b - a - covered(a, b, backward) for a, b in kinds["comm"]),\n'),
]}
