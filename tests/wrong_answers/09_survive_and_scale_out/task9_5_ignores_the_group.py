"""All-reduces over the whole world whatever the group: the ranks of a subgroup wait for ranks
that never call it."""

TASK = "task9_5"
EXPECT = r"is the all-reduce\s+on the group it is given"
REPLACE = {"Preemption": [
    ("op=dist.ReduceOp.MAX, group=group)", "op=dist.ReduceOp.MAX)"),
]}
