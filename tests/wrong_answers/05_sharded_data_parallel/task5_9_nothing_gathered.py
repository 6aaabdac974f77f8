"""Leaves out the parameters FSDP2 gathers whole: a rank's parameters taken as its shards
alone, all the step."""

TASK = "task5_9"
EXPECT = r"nothing gathered: FSDP2 holds two blocks and the root gathered"
REPLACE = {"peak_bytes": [("gathered = (min(2, L) * block + root) if stage == 3 else 0",
                           "gathered = 0")]}
