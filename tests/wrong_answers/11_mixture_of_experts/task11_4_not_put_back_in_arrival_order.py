"""Sends the results back in the order the experts ran them (by local expert), not the order
the rows arrived (by source rank): with two experts a rank and two ranks, rows reach the wrong
tokens."""

TASK = "task11_4"
EXPECT = r"did rows come back to the wrong assignments"
REPLACE = {"expert_parallel_forward": [
    ("    returned = AllToAll.apply(done[torch.argsort(by_expert)], receive, send, group)\n",
     "    returned = AllToAll.apply(done, receive, send, group)\n"),
]}
