"""Lets torch.device's RuntimeError for a malformed name ("cuda:x") escape instead of ValueError."""

TASK = "task0_1"
EXPECT = r"choose_device\('cuda:x'\) .* raised RuntimeError: .*expected ValueError \(not a device index\)"


def choose_device(requested=None):
    import torch

    if requested is None or requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cpu":
        return torch.device("cpu")
    if requested == "cuda" or requested.startswith("cuda:"):
        device = torch.device(requested)
        if not torch.cuda.is_available():
            raise ValueError(f"{requested!r} was requested but CUDA is not available; use 'cpu'")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{requested!r} was requested but there is no such GPU")
        return device
    raise ValueError(f"unknown device {requested!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'")
