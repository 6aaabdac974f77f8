"""Numbers the micro-batches with one counter for all chunks, not one per chunk."""

TASK = "task7_5"
EXPECT = r"each runs the oldest micro-batch its chunk has not run"
REPLACE = {"interleaved": [("actions.append((kind, done[chunk], chunk))",
                            "actions.append((kind, step % num_micro_batches, chunk))")]}
