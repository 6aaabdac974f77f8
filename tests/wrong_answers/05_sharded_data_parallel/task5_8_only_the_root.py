"""Shards only the root: one group for the whole model, so every forward gathers all of it at
once, and the blocks are not groups of their own."""

TASK = "task5_8"
EXPECT = r"\['blocks.0', .*\] are not fully_shard-ed"
REPLACE = {"build_sharded": [
    ("    for block in model.blocks:\n"
     "        fully_shard(block)\n", ""),
]}
