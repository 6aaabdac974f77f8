"""The mask the wrong way round: each query sees the keys at or after it."""

TASK = "task10_3"
EXPECT = r"wrong way round"
REPLACE = {"attend_block": [
    ("        visible = k_positions[None, :] <= q_positions[:, None]\n",
     "        visible = k_positions[None, :] >= q_positions[:, None]\n"),
]}
