"""Exits inside the handler: the process stops wherever the signal found it, mid-step or
mid-save, without the checkpoint, and the other ranks wait for it."""

TASK = "task9_5"
EXPECT = r"must only\s+record the signal"
REPLACE = {"Preemption": [
    ("        self.caught = self.caught or signum  # nothing more: it may run anywhere in the step",
     "        raise SystemExit(128 + signum)"),
]}
