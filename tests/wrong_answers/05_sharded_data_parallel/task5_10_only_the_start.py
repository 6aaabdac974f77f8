"""Takes the backward's start as the peak and forgets its end, where every gradient is made."""

TASK = "task5_10"
EXPECT = r"only the backward's start"
REPLACE = {"zero_peak_bytes": [("return held + max(start, end)", "return held + start")]}
