"""Starts from out = 0 and lse = 0 and merges its own block like the others: an extra block of
weight e^0 = 1 in every softmax."""

TASK = "task10_5"
EXPECT = r"start from this rank's own block, not from zeros|ring_attention's out"
REPLACE = {"ring_attention": [
    ("    out, lse = attend_block(q, k, v, positions, positions, causal)  # sees itself: lse "
     "finite\n",
     "    out, lse = attend_block(q, k, v, positions, positions, causal)  # sees itself: lse "
     "finite\n"
     "    out, lse = merge_partials(torch.zeros_like(out), torch.zeros_like(lse), out, lse)\n"),
]}
