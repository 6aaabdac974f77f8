"""Seeds each rank's generator with seed + rank, as one seeds data order: the ranks draw
different wholes, and only rank 0's rows are the model's."""

TASK = "task5_8"
EXPECT = r"rank 0's rows of .* are GPT\(config, seed\)'s, but ranks \[1.*seed alone"
REPLACE = {"build_sharded": [
    ("model.init_weights(torch.Generator().manual_seed(seed))\n",
     "model.init_weights(torch.Generator().manual_seed(seed + torch.distributed.get_rank()))\n"),
]}
