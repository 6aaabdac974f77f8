"""Each rank stops when it has caught a signal itself: the others take another step, and its
next collective waits for a rank that will never come."""

TASK = "task9_5"
EXPECT = r"(every rank of the group must stop at the first boundary|requested is one all-reduce a step)"
REPLACE = {"Preemption": [
    ("        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)  # any rank's, on every rank\n",
     ""),
]}
