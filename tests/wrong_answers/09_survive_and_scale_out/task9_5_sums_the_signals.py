"""Agrees by summing: two ranks that caught SIGTERM (15) and SIGUSR1 (10) agree on 25, a signal
nobody sent, and exit with 153."""

TASK = "task9_5"
EXPECT = r"the agreed signal is the largest of the ranks. first signals"
REPLACE = {"Preemption": [
    ("op=dist.ReduceOp.MAX", "op=dist.ReduceOp.SUM"),
]}
