"""Never checks that the micro-batches go in equal rounds: 9 on 4 ranks is not 2 rounds."""

TASK = "task7_5"
EXPECT = r"max\(1, m // p\) = \d+ (equal )?rounds"
REPLACE = {"interleaved": [("if num_micro_batches % rounds:", "if False:")]}
