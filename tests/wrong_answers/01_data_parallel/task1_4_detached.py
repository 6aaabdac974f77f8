"""Detaches each output before joining them, so the backward never reaches the replicas."""

TASK = "task1_4"
EXPECT = r"cut off from the replicas' graphs"


def gather(outputs):
    return torch.cat([output.detach() for output in outputs], dim=0)
