"""Gives every stage the same number of layers, as if every layer took as long."""

TASK = "task7_8"
EXPECT = r"the slowest [\d.]+\. Weigh the layers. times.*neither equal numbers of layers"


def balance_by_time(seconds, num_stages):
    n = len(seconds)
    if not 1 <= num_stages <= n:
        raise ValueError(f"{n} layers cannot make {num_stages} stages")
    return [n // num_stages + (i < n % num_stages) for i in range(num_stages)]
