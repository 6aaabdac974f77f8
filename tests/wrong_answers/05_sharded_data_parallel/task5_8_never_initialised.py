"""Materialises the shards with to_empty and stops there: the parameters hold whatever was in
that memory, not the model's values."""

TASK = "task5_8"
EXPECT = r"differ from GPT\(config, seed\)'s .*after to_empty the memory holds whatever was there"
REPLACE = {"build_sharded": [
    ("    # The eager build's draws, each whole on every rank; each rank keeps its own rows.\n"
     "    model.init_weights(torch.Generator().manual_seed(seed))\n",
     ""),
]}
