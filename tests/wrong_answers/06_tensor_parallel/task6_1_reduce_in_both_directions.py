"""g all-reduces in backward too, as if every communication had to happen both ways."""

TASK = "task6_1"
EXPECT = r"ReduceFromParallel's backward ran .*no communication"


class ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
