"""Remembers the largest signal this rank caught, not its first: a SIGTERM after a SIGUSR1
turns the agreed SIGUSR1 (138) into SIGTERM (143)."""

TASK = "task9_5"
EXPECT = r"(not the last nor the largest|a rank's later signals do not count)"
REPLACE = {"Preemption": [
    ("        self.caught = self.caught or signum",
     "        self.caught = max(self.caught, signum)"),
]}
