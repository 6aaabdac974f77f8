"""Runs the experts on the rows as they arrived, cut by the counts per expert: but the rows
arrive by source rank first, so each expert gets some of another expert's rows."""

TASK = "task11_4"
EXPECT = r"did rows come back to the wrong assignments"
REPLACE = {"expert_parallel_forward": [
    ("    pieces = arrived[by_expert].split(from_each.sum(dim=0).tolist())\n",
     "    pieces = arrived.split(from_each.sum(dim=0).tolist())\n"),
    ("    returned = AllToAll.apply(done[torch.argsort(by_expert)], receive, send, group)\n",
     "    returned = AllToAll.apply(done, receive, send, group)\n"),
]}
