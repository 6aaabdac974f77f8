"""Drops the padding by keeping the buffer's first T * k rows: padding rows stay in the output
and the last real rows of the later groups are lost."""

TASK = "task11_6"
EXPECT = r"first T \* k rows, padding rows among"
REPLACE = {"grouped_experts": [
    ("    done = grouped_matmul(hidden, w_out, offs)[rows]",
     "    done = grouped_matmul(hidden, w_out, offs)[:flat.numel()]"),
]}
