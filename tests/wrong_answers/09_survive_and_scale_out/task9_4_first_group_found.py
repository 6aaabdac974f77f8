"""Returns the first disagreement of the first group it happens to look at, not the one
with the smallest sequence id."""

TASK = "task9_4"
EXPECT = r"the smallest id first|the name that sorts first"
REPLACE = {"first_mismatch": [
    ('    seq, name, seen = min(found, key=lambda item: (item[0], item[1]))',
     '    seq, name, seen = found[0]'),
]}
