"""Splits a mixture's experts across the GPUs whenever there are several, even when the whole
model and its training state fit on every GPU, where the table keeps plain DDP."""

TASK = "task8_4"
EXPECT = r"an MoE that fits each GPU: choose_method.*returned 'ep\+fsdp'; the table says 'ddp'"
REPLACE = {"choose_method": [
    ("    state = 4 * model_bytes\n",
     "    state = 4 * model_bytes\n"
     "    if moe and num_gpus > 1:\n"
     "        return \"ep+fsdp\"\n"),
]}
