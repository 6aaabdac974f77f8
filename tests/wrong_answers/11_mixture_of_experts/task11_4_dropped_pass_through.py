"""Gives a dropped assignment the token itself instead of 0: the block's residual connection
adds the token again, so a dropped token counts twice."""

TASK = "task11_4"
EXPECT = r"a dropped assignment added the token itself"
REPLACE = {"expert_parallel_forward": [
    ("    slots = returned.new_zeros(experts.numel(), returned.shape[-1]).index_copy(0, order, "
     "returned)\n",
     "    slots = tokens.repeat_interleave(k, dim=0).index_copy(0, order, returned)\n"),
]}
