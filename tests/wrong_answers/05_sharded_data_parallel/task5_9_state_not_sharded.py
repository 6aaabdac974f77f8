"""Takes every rank's state as DDP's, whatever the stage: FSDP2's sharding forgotten."""

TASK = "task5_9"
EXPECT = r"DDP.s state: stage 3 shards it"
REPLACE = {"peak_bytes": [
    ("state = 0 if offload else memory_per_rank(psi, world_size, stage)[\"total\"]",
     "state = 0 if offload else 16 * psi")]}
