"""1F1B warms up with p - s forwards instead of p - s - 1: one activation too many on each stage."""

TASK = "task7_1"
EXPECT = r"holds the activations of up to \d+ micro-batches at once, expected \d+"


def schedule(kind, num_stages, num_micro_batches):
    if kind not in KINDS or num_stages < 1 or num_micro_batches < 1:
        raise ValueError("bad arguments")
    stages = []
    for stage in range(num_stages):
        if kind == "gpipe":
            actions = [("F", i) for i in range(num_micro_batches)]
            actions += [("B", i) for i in reversed(range(num_micro_batches))]
        else:
            warmup = min(num_stages - stage, num_micro_batches)
            actions = [("F", i) for i in range(warmup)]
            for i in range(num_micro_batches - warmup):
                actions += [("F", warmup + i), ("B", i)]
            actions += [("B", i) for i in range(num_micro_batches - warmup, num_micro_batches)]
        stages.append(actions)
    return stages
