"""Offloads only AdamW's state, as optimizer offloading elsewhere does: the shards and their
gradients counted on the GPU."""

TASK = "task5_9"
EXPECT = r"the parameters and gradients on the GPU: CPUOffloadPolicy keeps the shards"
REPLACE = {"peak_bytes": [
    ("state = 0 if offload else memory_per_rank(psi, world_size, stage)[\"total\"]",
     "memory = memory_per_rank(psi, world_size, stage)\n"
     "    state = memory[\"total\"] - (memory[\"optimizer_state\"] if offload else 0)")]}
