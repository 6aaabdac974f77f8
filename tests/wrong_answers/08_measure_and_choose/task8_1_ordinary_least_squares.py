"""Fits the line by ordinary least squares: the largest times hold it, and 1 % of noise at
64 MiB is more than the whole latency the small sizes measure."""

TASK = "task8_1"
EXPECT = r"that is the ordinary least-squares line"


def fit_alpha_beta(sizes, seconds, world_size):
    if len(sizes) != len(seconds):
        raise ValueError("one time per size")
    if len(set(sizes)) < 2:
        raise ValueError("two distinct sizes")
    if world_size < 2:
        raise ValueError("two ranks")
    if min(seconds) <= 0:
        raise ValueError("positive times")
    n = torch.tensor(sizes, dtype=torch.float64)
    t = torch.tensor(seconds, dtype=torch.float64)
    b = ((n - n.mean()) * (t - t.mean())).sum() / ((n - n.mean()) ** 2).sum()
    a = t.mean() - b * n.mean()
    steps = 2 * (world_size - 1)
    return float(a) / steps, float(b) / (steps / world_size)
