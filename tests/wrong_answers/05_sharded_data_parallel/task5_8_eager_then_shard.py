"""Builds the GPT eagerly, then shards it: the values are right, but every rank held the whole
model first, which is what a model too large for one rank cannot do."""

TASK = "task5_8"
EXPECT = r"held [\d,]+ bytes at once while building, more than its shards"
REPLACE = {"build_sharded": [
    ('    with torch.device("meta"):\n'
     "        model = GPT(config, seed)  # its own init draws, one weight at a time, onto meta: lost\n",
     "    model = GPT(config, seed)\n"),
    ("    model.to_empty(device=device)  # this rank's shards, uninitialised\n"
     "    # The eager build's draws, each whole on every rank; each rank keeps its own rows.\n"
     "    model.init_weights(torch.Generator().manual_seed(seed))\n",
     "    model.to(device)\n"),
]}
