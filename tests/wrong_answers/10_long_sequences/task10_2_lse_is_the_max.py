"""Weighs the outputs rightly but returns the larger lse as the merged one: the next merge then
weighs this pair too little."""

TASK = "task10_2"
EXPECT = r"lse is the larger of the two"
REPLACE = {"merge_partials": [
    ("    return out, lse", "    return out, top"),
]}
