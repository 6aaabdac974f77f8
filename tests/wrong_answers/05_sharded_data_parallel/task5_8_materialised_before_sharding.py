"""Builds on meta but materialises and initialises before fully_shard: the right values, from
a whole model on every rank."""

TASK = "task5_8"
EXPECT = r"to_empty gave memory to \['tok_emb.weight'.*before they were sharded"
REPLACE = {"build_sharded": [
    ("    for block in model.blocks:\n"
     "        fully_shard(block)\n"
     "    fully_shard(model)\n"
     "    model.to_empty(device=device)  # this rank's shards, uninitialised\n"
     "    # The eager build's draws, each whole on every rank; each rank keeps its own rows.\n"
     "    model.init_weights(torch.Generator().manual_seed(seed))\n",
     "    model.to_empty(device=device)\n"
     "    model.init_weights(torch.Generator().manual_seed(seed))\n"
     "    for block in model.blocks:\n"
     "        fully_shard(block)\n"
     "    fully_shard(model)\n"),
]}
