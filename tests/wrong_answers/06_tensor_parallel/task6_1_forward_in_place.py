"""g all-reduces its input in place and returns it."""

TASK = "task6_1"
EXPECT = r"changed its input x in place"


class ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group=None):
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None
