"""GPipe's last stage runs its backwards in forward order, the others last micro-batch first:
no deadlock on paper, but each receive would get another micro-batch's gradient."""

TASK = "task7_1"
EXPECT = r"wrong micro-batches: stage \d sends its gradients in the order"


def schedule(kind, num_stages, num_micro_batches):
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError(f"need at least one stage and one micro-batch, got {num_stages} and "
                         f"{num_micro_batches}")
    stages = []
    for stage in range(num_stages):
        if kind == "gpipe":
            order = list(range(num_micro_batches))
            backwards = order if stage == num_stages - 1 else order[::-1]
            actions = [("F", i) for i in order] + [("B", i) for i in backwards]
        else:
            warmup = min(num_stages - stage - 1, num_micro_batches)
            actions = [("F", i) for i in range(warmup)]
            for i in range(num_micro_batches - warmup):
                actions += [("F", warmup + i), ("B", i)]
            actions += [("B", i) for i in range(num_micro_batches - warmup, num_micro_batches)]
        stages.append(actions)
    return stages
