"""f's all-reduce leaves out group=: it sums over every rank, not over its tensor-parallel group."""

TASK = "task6_1"
EXPECT = r"sum over all 4 ranks, not over this rank's group of 2"


class CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group=None):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad, None
