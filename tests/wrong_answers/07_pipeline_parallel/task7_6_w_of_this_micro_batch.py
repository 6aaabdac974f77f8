"""Runs the W of the micro-batch whose B just ran, not the oldest W still to run."""

TASK = "task7_6"
EXPECT = r"each W is the oldest that has not run"


def zero_bubble(num_stages, num_micro_batches):
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError("need a stage and a micro-batch")
    stages = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage - 1, num_micro_batches)
        actions = [("F", i) for i in range(warmup)]
        for j in range(num_micro_batches):
            if warmup + j < num_micro_batches:
                actions.append(("F", warmup + j))
            actions.append(("B", j))
            if j >= stage:
                actions.append(("W", j))
        actions += [("W", i) for i in range(min(stage, num_micro_batches))]
        stages.append(actions)
    return stages
