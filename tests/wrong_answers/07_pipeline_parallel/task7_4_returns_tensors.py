"""Returns torch's loss tensors as they are, graph and all, instead of numbers."""

TASK = "task7_4"
EXPECT = r"should return the losses as floats"


def torch_step(schedule, stage, num_stages, inputs, targets):
    losses = []
    first, last = stage == 0, stage == num_stages - 1
    if first and last:
        schedule.step(inputs, target=targets, losses=losses)
    elif first:
        schedule.step(inputs)
    elif last:
        schedule.step(target=targets, losses=losses)
    else:
        schedule.step()
    return losses
