"""Keeps tensor parallelism inside the node under context parallelism whatever the link: over
PCIe the ring runs over every GPU instead, where tensor parallelism's all-reduces would wait
between the layers."""

TASK = "task8_4"
EXPECT = r"over PCIe: choose_method.*returned 'cp\+tp\+fsdp'; the table says 'cp\+fsdp'"
REPLACE = {"choose_method": [
    ("        return experts + (\"cp+tp+fsdp\" if link == \"nvlink\" else \"cp+fsdp\")\n",
     "        return experts + \"cp+tp+fsdp\"\n"),
]}
