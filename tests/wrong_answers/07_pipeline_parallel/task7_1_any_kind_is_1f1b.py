"""Anything that is not "gpipe" is taken for 1F1B, "zero-bubble" included."""

TASK = "task7_1"
EXPECT = r"schedule\('zero-bubble', 2, 4\) returned .*raise ValueError"


def schedule(kind, num_stages, num_micro_batches):
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError("bad arguments")
    stages = []
    for stage in range(num_stages):
        if kind == "gpipe":
            actions = [("F", i) for i in range(num_micro_batches)]
            actions += [("B", i) for i in reversed(range(num_micro_batches))]
        else:
            warmup = min(num_stages - stage - 1, num_micro_batches)
            actions = [("F", i) for i in range(warmup)]
            for i in range(num_micro_batches - warmup):
                actions += [("F", warmup + i), ("B", i)]
            actions += [("B", i) for i in range(num_micro_batches - warmup, num_micro_batches)]
        stages.append(actions)
    return stages
