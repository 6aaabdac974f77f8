"""Puts expert parallelism only in front of FSDP alone: once the activations must be split too,
the experts are gathered again, though the experts and the activations are split independently."""

TASK = "task8_4"
EXPECT = r"long sequences: choose_method.*returned '(tp|pp)\+fsdp'; the table says 'ep\+(tp|pp)\+fsdp'"
REPLACE = {"choose_method": [
    ("        return experts + (\"tp+fsdp\" if link == \"nvlink\" else \"pp+fsdp\")\n",
     "        return \"tp+fsdp\" if link == \"nvlink\" else \"pp+fsdp\"\n"),
    ("        return experts + (\"cp+tp+fsdp\" if link == \"nvlink\" else \"cp+fsdp\")\n",
     "        return \"cp+tp+fsdp\" if link == \"nvlink\" else \"cp+fsdp\"\n"),
]}
