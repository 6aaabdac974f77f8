"""Splits the activations by the number of nodes under context parallelism, as if the ring
replaced the node's split instead of adding to it: tensor (or pipeline) parallelism still
splits them inside each node, so the two together split them over every GPU."""

TASK = "task8_4"
EXPECT = r"128k-token sequences: choose_method.*returned 'ValueError.*the table says 'cp\+tp\+fsdp'"
REPLACE = {"choose_method": [
    ("    smallest = (state + activation_bytes) / num_gpus\n",
     "    smallest = state / num_gpus + activation_bytes / (num_gpus // gpus_per_node)\n"),
]}
