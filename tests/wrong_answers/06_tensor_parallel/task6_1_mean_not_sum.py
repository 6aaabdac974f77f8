"""g averages the ranks' partial results, as DDP averages gradients, instead of summing them."""

TASK = "task6_1"
EXPECT = r"1/\d of the expected"


class ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group=None):
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total / dist.get_world_size(group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None
