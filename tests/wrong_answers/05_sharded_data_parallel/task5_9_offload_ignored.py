"""Takes offload as changing nothing on the GPU: the state counted there, as without it."""

TASK = "task5_9"
EXPECT = r"the state on the GPU: with offload the shards, their gradients and AdamW's state live"
REPLACE = {"peak_bytes": [
    ("state = 0 if offload else memory_per_rank(psi, world_size, stage)[\"total\"]",
     "state = memory_per_rank(psi, world_size, stage)[\"total\"]")]}
