"""Masks with -1e9 instead of -inf: a row that sees no key gets a softmax over the masked keys
(the mean of the values) and an lse near -1e9, not zeros and -inf."""

TASK = "task10_3"
EXPECT = r"large negative number instead of\s+-inf"
REPLACE = {"attend_block": [
    ('        scores = scores.masked_fill(~visible, float("-inf"))\n',
     '        scores = scores.masked_fill(~visible, -1e9)\n'),
]}
