"""One all-gather per group, as if every unit kept its parameters from forward to backward
(ZeRO-2's traffic): a unit that resharded gathers again before its backward."""

TASK = "task8_6"
EXPECT = r"gathers them again before its backward"
REPLACE = {"fsdp_step_collectives": [
    ("        gathers = 2 if reshard_after_forward and not is_root else 1\n",
     "        gathers = 1\n"),
]}
