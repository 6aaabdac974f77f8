"""Catches SIGTERM only: the time limit's SIGUSR1 (--signal=USR1@90) ends the process at once,
the default action, with no checkpoint."""

TASK = "task9_5"
EXPECT = r"(handles each of its signals|catch both by default)"
REPLACE = {"Preemption": [
    ("signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)",
     "signals: tuple[int, ...] = (signal.SIGTERM,)"),
]}
