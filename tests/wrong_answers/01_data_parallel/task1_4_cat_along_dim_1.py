"""Concatenates the outputs along dim 1 (the features) instead of dim 0 (the batch)."""

TASK = "task1_4"
EXPECT = r"along dim 0"


def gather(outputs):
    return torch.cat(outputs, dim=1)
