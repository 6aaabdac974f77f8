"""A line through the smallest and the largest size, not the least-squares line through every
point: exact points fit, noisy ones do not."""

TASK = "task8_1"
EXPECT = r"smallest relative errors, through all of them"


def fit_alpha_beta(sizes, seconds, world_size):
    if len(sizes) != len(seconds) or len(set(sizes)) < 2 or world_size < 2:
        raise ValueError("cannot fit")
    low, high = sizes.index(min(sizes)), sizes.index(max(sizes))
    b = (seconds[high] - seconds[low]) / (sizes[high] - sizes[low])
    a = seconds[low] - b * sizes[low]
    steps = 2 * (world_size - 1)
    return a / steps, b / (steps / world_size)
