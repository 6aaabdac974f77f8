"""f's backward all-reduces the gradient, then all-reduces the sum again: W times too large."""

TASK = "task6_1"
EXPECT = r"\dx the expected one: one all-reduce too many in backward"


class CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
