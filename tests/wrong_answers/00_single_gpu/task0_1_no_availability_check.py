"""Trusts torch.device() to refuse "cuda" on a machine without a GPU (it does not)."""

TASK = "task0_1"
EXPECT = r"choose_device\('cuda(:0)?'\) on a machine with 0 GPU\(s\) returned .*expected ValueError \(CUDA is not available\)"


def choose_device(requested=None):
    import torch

    if requested is None or requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(requested)
    except RuntimeError:
        raise ValueError(f"unknown device {requested!r}: use 'auto', 'cpu' or 'cuda:N'") from None
