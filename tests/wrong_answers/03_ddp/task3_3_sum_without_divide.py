"""Sums the gradients over the ranks but never divides by the world size."""

TASK = "task3_3"
EXPECT = r"averaged gradient .* differ.*without dividing"


def average_gradients(model):
    import torch.distributed as dist

    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
