"""Keeps an event's whole duration when it runs past the end of the step: the step's own
reading then holds time that belongs to the next step."""

TASK = "task8_5"
EXPECT = r"counts up to 200 only"
REPLACE = {"read_step": [
    ('            kinds[kind].append((start, min(start + float(event["dur"]), end)))\n',
     '            kinds[kind].append((start, start + float(event["dur"])))\n'),
]}
