"""Adds the context-parallel row but keeps the old error: when nothing fits it reports the bytes
of the split inside one node, not those of the smallest option, every GPU's share of both."""

TASK = "task8_4"
EXPECT = r"should say the 1000000000 bytes each GPU would need with the smallest option"
REPLACE = {"choose_method": [
    ("    raise ValueError(f\"even with the state and the activations split {num_gpus} ways, each GPU \"\n"
     "                     f\"needs {smallest:.0f} bytes",
     "    smallest = state / num_gpus + activation_bytes / gpus_per_node\n"
     "    raise ValueError(f\"even with the state and the activations split {num_gpus} ways, each GPU \"\n"
     "                     f\"needs {smallest:.0f} bytes"),
]}
