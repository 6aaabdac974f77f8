"""Joins the outputs in reverse replica order (the last replica's rows first)."""

TASK = "task1_4"
EXPECT = r"gathered outputs of chunks \[4, 4, 2\] \(replica 0's rows first, then replica 1's\)"


def gather(outputs):
    return torch.cat(list(reversed(outputs)), dim=0)
