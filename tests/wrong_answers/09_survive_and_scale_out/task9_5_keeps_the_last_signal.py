"""Remembers the last signal, not the first: a SIGTERM after a SIGUSR1 changes what the rank
reports."""

TASK = "task9_5"
EXPECT = r"(the first signal caught is\s+the one remembered|a rank's later signals do not count)"
REPLACE = {"Preemption": [
    ("        self.caught = self.caught or signum", "        self.caught = signum"),
]}
