"""Returns the fitted line's intercept and slope as alpha and beta, without turning them into
the ring's per-step latency and per-byte time."""

TASK = "task8_1"
EXPECT = r"fitted to exact points on \d ranks"


def fit_alpha_beta(sizes, seconds, world_size):
    import torch

    if len(sizes) != len(seconds) or len(set(sizes)) < 2 or world_size < 2:
        raise ValueError("cannot fit")
    n = torch.tensor(sizes, dtype=torch.float64)
    t = torch.tensor(seconds, dtype=torch.float64)
    b = ((n - n.mean()) * (t - t.mean())).sum() / ((n - n.mean()) ** 2).sum()
    return float(t.mean() - b * n.mean()), float(b)
