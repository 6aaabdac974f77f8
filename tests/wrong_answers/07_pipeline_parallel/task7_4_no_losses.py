"""Steps the last stage without a list for the losses: training works, the losses are lost."""

TASK = "task7_4"
EXPECT = r"the last stage's micro-batch losses from torch_step"


def torch_step(schedule, stage, num_stages, inputs, targets):
    first, last = stage == 0, stage == num_stages - 1
    if first and last:
        schedule.step(inputs, target=targets)
    elif first:
        schedule.step(inputs)
    elif last:
        schedule.step(target=targets)
    else:
        schedule.step()
    return []
