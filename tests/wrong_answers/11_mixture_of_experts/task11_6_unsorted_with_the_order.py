"""Puts the rows back with the sort order itself (rows[order]) instead of its inverse: each
token gets another assignment's expert output."""

TASK = "task11_6"
EXPECT = r"put back with the sort order itself"
REPLACE = {"grouped_experts": [
    ("    per_assignment = done.new_zeros(done.shape).index_copy(0, order, done)\n",
     "    per_assignment = done[order]\n"),
]}
