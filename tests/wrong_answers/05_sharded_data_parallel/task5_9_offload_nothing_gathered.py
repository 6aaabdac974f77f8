"""Takes offload to keep every parameter off the GPU, the gathered ones too."""

TASK = "task5_9"
EXPECT = r"nothing gathered: FSDP2 holds two blocks and the root gathered, offloaded or not"
REPLACE = {"peak_bytes": [("gathered = (min(2, L) * block + root) if stage == 3 else 0",
                           "gathered = (min(2, L) * block + root) "
                           "if stage == 3 and not offload else 0")]}
