"""Takes a new agreement at every boundary: a larger signal caught later by another rank
changes the signal and the exit code after the ranks have already decided to stop."""

TASK = "task9_5"
EXPECT = r"fixed from then on"
REPLACE = {"Preemption": [
    ("        if not self.signal:  # the first agreement stands\n            self.signal",
     "        if True:\n            self.signal"),
]}
