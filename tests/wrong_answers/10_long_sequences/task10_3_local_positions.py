"""Masks by place in the block (a lower triangle) instead of by the tokens' positions in the
whole sequence: a block from earlier in the sequence loses half its keys."""

TASK = "task10_3"
EXPECT = r"mask by place in the block"
REPLACE = {"attend_block": [
    ("        visible = k_positions[None, :] <= q_positions[:, None]\n",
     "        visible = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool,\n"
     "                             device=q.device).tril()\n"),
]}
