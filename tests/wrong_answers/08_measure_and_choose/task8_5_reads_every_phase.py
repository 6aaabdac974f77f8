"""Reads every event of the trace as if it had a start and a duration: its metadata, instant and
flow events have none."""

TASK = "task8_5"
EXPECT = r"only complete events"
REPLACE = {"read_step": [
    ('    complete = [event for event in events if event.get("ph") == "X"]\n',
     '    complete = [event for event in events if "name" in event]\n'),
]}
