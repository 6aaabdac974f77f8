"""Every stage warms up with p - 1 forwards, as the first must: the later stages hold too much."""

TASK = "task7_1"
EXPECT = r"1F1B's stage s warms up with p - s - 1 forwards"


def schedule(kind, num_stages, num_micro_batches):
    if kind not in KINDS or num_stages < 1 or num_micro_batches < 1:
        raise ValueError("bad arguments")
    stages = []
    for _stage in range(num_stages):
        if kind == "gpipe":
            actions = [("F", i) for i in range(num_micro_batches)]
            actions += [("B", i) for i in reversed(range(num_micro_batches))]
        else:
            warmup = min(num_stages - 1, num_micro_batches)
            actions = [("F", i) for i in range(warmup)]
            for i in range(num_micro_batches - warmup):
                actions += [("F", warmup + i), ("B", i)]
            actions += [("B", i) for i in range(num_micro_batches - warmup, num_micro_batches)]
        stages.append(actions)
    return stages
