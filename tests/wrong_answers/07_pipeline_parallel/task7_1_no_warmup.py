"""1F1B without a warm-up: every stage alternates from the start, and the pipeline never fills."""

TASK = "task7_1"
EXPECT = r"the stages are idle .* of the time, expected \(p - 1\) / \(m \+ p - 1\)"


def schedule(kind, num_stages, num_micro_batches):
    if kind not in KINDS or num_stages < 1 or num_micro_batches < 1:
        raise ValueError("bad arguments")
    if kind == "gpipe":
        actions = [("F", i) for i in range(num_micro_batches)]
        actions += [("B", i) for i in reversed(range(num_micro_batches))]
    else:
        actions = [a for i in range(num_micro_batches) for a in (("F", i), ("B", i))]
    return [list(actions) for _ in range(num_stages)]
