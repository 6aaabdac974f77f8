"""Refuses "cuda" without a GPU, but the message does not tell the user to use 'cpu' instead."""

TASK = "task0_1"
EXPECT = r"the message should tell the user the way out"


def choose_device(requested=None):
    import torch

    if requested is None or requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cpu":
        return torch.device("cpu")
    if requested == "cuda" or requested.startswith("cuda:"):
        try:
            device = torch.device(requested)
        except RuntimeError:
            raise ValueError(f"bad device name {requested!r}") from None
        if not torch.cuda.is_available():
            raise ValueError("no GPU found")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"there is no GPU {device.index}")
        return device
    raise ValueError(f"unknown device {requested!r}")
