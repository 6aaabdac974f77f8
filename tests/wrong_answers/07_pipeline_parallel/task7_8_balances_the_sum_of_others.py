"""Minimises the gap between the slowest and the fastest stage instead of the slowest stage."""

TASK = "task7_8"
EXPECT = r"the slowest \d|both have a slowest stage of"


def balance_by_time(seconds, num_stages):
    n = len(seconds)
    if not 1 <= num_stages <= n:
        raise ValueError(f"{n} layers cannot make {num_stages} stages")
    best = None
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        bounds = (0, *cuts, n)
        times = [sum(seconds[a:b]) for a, b in itertools.pairwise(bounds)]
        gap = max(times) - min(times)
        if best is None or gap < best[0]:
            best = (gap, bounds)
    return [end - start for start, end in itertools.pairwise(best[1])]
