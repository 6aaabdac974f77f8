"""Does not check the thread: entered elsewhere, signal.signal's own ValueError comes out of
deep inside, instead of a RuntimeError that says what to do."""

TASK = "task9_5"
EXPECT = r"raise RuntimeError that says 'main thread'"
REPLACE = {"Preemption": [
    ("        if threading.current_thread() is not threading.main_thread():\n"
     "            raise RuntimeError(\"enter Preemption in the main thread: Python runs signal \"\n"
     "                               \"handlers there only\")\n", ""),
]}
