"""Stacks the outputs (a new leading dim) instead of concatenating them along the batch dim."""

TASK = "task1_4"
EXPECT = r"torch\.stack|along dim 0"


def gather(outputs):
    return torch.stack(outputs)
