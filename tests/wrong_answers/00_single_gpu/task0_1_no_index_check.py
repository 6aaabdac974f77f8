"""Checks that CUDA is available but not that cuda:N is below torch.cuda.device_count()."""

TASK = "task0_1"
EXPECT = r"choose_device\('cuda:\d'\) on a machine with \d GPU\(s\) returned device\(type='cuda', index=\d\); expected ValueError \(there is no (second|third) GPU\)"


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
            raise ValueError(f"bad device {requested!r}: write 'cuda' or 'cuda:N'") from None
        if not torch.cuda.is_available():
            raise ValueError(f"{requested!r} was requested but CUDA is not available; use 'cpu'")
        return device
    raise ValueError(f"unknown device {requested!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'")
