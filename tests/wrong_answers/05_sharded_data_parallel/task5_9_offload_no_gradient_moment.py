"""Takes offload to put the gradients on the CPU as they are made: a block's whole gradients
left out of the moments."""

TASK = "task5_9"
EXPECT = r"no block's whole gradients: they are made on the GPU and reduce-scattered there"
REPLACE = {"peak_bytes": [("gradient = block if stage == 3 else max(4 * C * C, V * C)",
                           "gradient = (0 if offload else block) if stage == 3 "
                           "else max(4 * C * C, V * C)")]}
