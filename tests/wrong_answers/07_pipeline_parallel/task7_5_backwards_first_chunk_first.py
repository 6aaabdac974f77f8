"""Runs the backwards through the chunks in the forwards' order, chunk 0 first, when the
gradient arrives first at the last chunk."""

TASK = "task7_5"
EXPECT = r"Its backwards run the chunks .*the rule is chunk v - 1 - \(j // n\) % v"
REPLACE = {"interleaved": [("lambda turn: num_chunks - 1 - turn % num_chunks",
                            "lambda turn: turn % num_chunks")]}
