"""Tries context parallelism before tensor parallelism inside the node: it fits wherever
tp+fsdp fits, so the table's earlier, cheaper row is never chosen."""

TASK = "task8_4"
EXPECT = r"long sequences: choose_method.*returned 'cp\+tp\+fsdp'; the table says 'tp\+fsdp'"
REPLACE = {"choose_method": [
    ("    if state / num_gpus + activation_bytes / gpus_per_node <= gpu_memory:\n"
     "        return experts + (\"tp+fsdp\" if link == \"nvlink\" else \"pp+fsdp\")\n"
     "    smallest = (state + activation_bytes) / num_gpus\n"
     "    if smallest <= gpu_memory:\n"
     "        return experts + (\"cp+tp+fsdp\" if link == \"nvlink\" else \"cp+fsdp\")\n",
     "    smallest = (state + activation_bytes) / num_gpus\n"
     "    if smallest <= gpu_memory:\n"
     "        return experts + (\"cp+tp+fsdp\" if link == \"nvlink\" else \"cp+fsdp\")\n"),
]}
