"""1F1B's warm-up of p - s - 1 forwards even when there are fewer micro-batches than that."""

TASK = "task7_1"
EXPECT = r"is not a schedule|deadlocks|micro-batches 0 to"


def schedule(kind, num_stages, num_micro_batches):
    if kind not in KINDS or num_stages < 1 or num_micro_batches < 1:
        raise ValueError("bad arguments")
    stages = []
    for stage in range(num_stages):
        if kind == "gpipe":
            actions = [("F", i) for i in range(num_micro_batches)]
            actions += [("B", i) for i in reversed(range(num_micro_batches))]
        else:
            warmup = num_stages - stage - 1
            actions = [("F", i) for i in range(warmup)]
            for i in range(num_micro_batches - warmup):
                actions += [("F", warmup + i), ("B", i)]
            actions += [("B", i) for i in range(num_micro_batches - warmup, num_micro_batches)]
        stages.append(actions)
    return stages
