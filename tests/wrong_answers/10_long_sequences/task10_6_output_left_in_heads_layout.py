"""Exchanges q, k and v but returns attention's output as it is: one exchange, no way back, so
each rank holds the whole sequence of its heads instead of its tokens of every head."""

TASK = "task10_6"
EXPECT = r"the heads'\s+layout"
REPLACE = {"ulysses_attention": [
    ("    return SeqAllToAll.apply(out, 2, 1, group)", "    return out"),
]}
