"""Attends to its own block with detached keys and values (as if the ring's copies were all it
had): out, lse and q's gradient are right, but this rank's own k and v get no gradient, and the
projections that made them would never learn from the rank's own queries."""

TASK = "task10_5"
EXPECT = r"no gradient reached this rank's own k through ring_attention"
REPLACE = {"ring_attention": [
    ("    out, lse = attend_block(q, k, v, positions, positions, causal)",
     "    out, lse = attend_block(q, k.detach(), v.detach(), positions, positions, causal)"),
]}
