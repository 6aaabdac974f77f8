"""Refuses a count of 0 but lets a negative one through (== 0 where < 1 is meant)."""

TASK = "task7_5"
EXPECT = r"interleaved\(.*-\d.*\) returned .*raise ValueError: every count must be at least 1"
REPLACE = {"interleaved": [("if num_ranks < 1 or num_chunks < 1 or num_micro_batches < 1:",
                            "if num_ranks == 0 or num_chunks == 0 or num_micro_batches == 0:")]}
