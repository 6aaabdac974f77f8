"""Takes every event that overlaps the step, also one that started before it: the end of the
previous step's backward is read as this step's."""

TASK = "task8_5"
EXPECT = r"starts at or after the step's\s+start"
REPLACE = {"read_step": [
    ('        if kind is not None and begin <= start < end:\n'
     '            kinds[kind].append((start, min(start + float(event["dur"]), end)))\n',
     '        if kind is not None and start < end and start + float(event["dur"]) > begin:\n'
     '            kinds[kind].append((max(start, begin), min(start + float(event["dur"]), end)))\n'),
]}
