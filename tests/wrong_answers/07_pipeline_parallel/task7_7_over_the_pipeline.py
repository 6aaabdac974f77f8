"""Averages over mesh["pp"], the stages of one copy of the pipeline, not over the copies."""

TASK = "task7_7"
EXPECT = r"averaged over the pipeline \(mesh\['pp'\]\), the other stages, not the copies"


def average_over_copies(module, mesh):
    stages = mesh["pp"]
    if stages.size() == 1:
        return
    for parameter in module.parameters():
        if parameter.grad is not None:
            dist.all_reduce(parameter.grad, group=stages.get_group())
            parameter.grad /= stages.size()
