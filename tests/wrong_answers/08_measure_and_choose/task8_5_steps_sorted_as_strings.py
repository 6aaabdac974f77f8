"""Keeps the step numbers as the strings of the names: "10" sorts before "9", so the first step
of a trace that goes past 9 is taken to be ProfilerStep#10."""

TASK = "task8_5"
EXPECT = r"as a number"
REPLACE = {"read_step": [
    ('            steps[int(found.group(1))] = event\n',
     '            steps[found.group(1)] = event\n'),
    ('    number = min(steps, default=None) if step is None else step\n',
     '    number = min(steps, default=None) if step is None else str(step)\n'),
]}
