"""Reads the new argument but never uses it: a mixture of experts gets the dense model's method,
so FSDP would gather every expert to every GPU in every layer though each token uses k of them."""

TASK = "task8_4"
EXPECT = r"64-expert MoE, 8 nodes: choose_method.*returned 'fsdp'; the table says 'ep\+fsdp'"
REPLACE = {"choose_method": [
    ("    experts = \"ep+\" if moe else \"\"", "    experts = \"\""),
]}
