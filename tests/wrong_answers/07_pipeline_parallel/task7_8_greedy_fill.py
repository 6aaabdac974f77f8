"""Fills each stage with layers until it reaches the average stage time, then starts the next:
a greedy cut, not the best one."""

TASK = "task7_8"
EXPECT = r"the slowest [\d.]+\. Weigh the layers. times.*nor a greedy fill"


def balance_by_time(seconds, num_stages):
    n = len(seconds)
    if not 1 <= num_stages <= n:
        raise ValueError(f"{n} layers cannot make {num_stages} stages")
    target = sum(seconds) / num_stages
    counts, current, total = [], 0, 0.0
    for i, t in enumerate(seconds):
        left_layers, left_stages = n - i, num_stages - len(counts)
        if current and (total + t > target or left_layers < left_stages) and \
                len(counts) < num_stages - 1:
            counts.append(current)
            current, total = 0, 0.0
        current += 1
        total += t
    counts.append(current)
    return counts
