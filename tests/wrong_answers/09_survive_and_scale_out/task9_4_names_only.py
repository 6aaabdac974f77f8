"""Compares the operations' names only: an all_reduce of 4 elements on one rank and of 5 on
another passes as the same collective."""

TASK = "task9_4"
EXPECT = r"input_sizes must agree too"
REPLACE = {"first_mismatch": [
    ('            if len(set(seen.values())) > 1:',
     '            if len({call and call[0] for call in seen.values()}) > 1:'),
]}
