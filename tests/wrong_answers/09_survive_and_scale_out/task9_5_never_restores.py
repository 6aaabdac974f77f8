"""Leaves its handlers installed after the block: a later SIGTERM is swallowed, and the process
no longer ends when it is asked to."""

TASK = "task9_5"
EXPECT = r"put (them|every old handler) back"
REPLACE = {"Preemption": [
    ("        for sig, handler in self._previous.items():  # None: one installed outside Python\n"
     "            signal.signal(sig, signal.SIG_DFL if handler is None else handler)",
     "        pass"),
]}
