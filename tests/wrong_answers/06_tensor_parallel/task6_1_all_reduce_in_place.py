"""f's backward all-reduces the gradient tensor autograd handed in, in place."""

TASK = "task6_1"
EXPECT = r"residual path's gradient was all-reduced too"


class CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group=None):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
