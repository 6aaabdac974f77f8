"""Materialises between sharding the blocks and sharding the root: the blocks arrive as
shards, but the embeddings and the head are given memory whole on every rank first."""

TASK = "task5_8"
EXPECT = r"to_empty gave memory to \['tok_emb.weight'.*before they were sharded"
REPLACE = {"build_sharded": [
    ("    fully_shard(model)\n"
     "    model.to_empty(device=device)  # this rank's shards, uninitialised\n",
     "    model.to_empty(device=device)\n"
     "    fully_shard(model)\n"),
]}
