"""Materialises the shards with to_empty and stops there: the parameters hold whatever was in
that memory, not the model's values."""

TASK = "task5_8"
EXPECT = r"differ from GPT\(config, seed\)'s .*after to_empty the memory holds whatever was there"
REPLACE = {"build_sharded": [
    ("    with implicit_replication():  # a whole plain tensor stands for the same one on every rank\n"
     "        model.init_weights(torch.Generator().manual_seed(seed))  # the eager build's draws\n",
     ""),
]}
