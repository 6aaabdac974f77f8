"""Shards the blocks with one call, fully_shard(list(model.blocks)): every block becomes an
FSDP module, but they share one group, gathered and freed together, all of them at once."""

TASK = "task5_8"
EXPECT = r"the blocks share one fully_shard group"
REPLACE = {"build_sharded": [
    ("    for block in model.blocks:\n"
     "        fully_shard(block)\n",
     "    fully_shard(list(model.blocks))\n"),
]}
