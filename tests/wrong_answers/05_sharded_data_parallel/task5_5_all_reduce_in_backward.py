"""Backward all-reduces the whole gradient and slices this rank's piece out of it."""

TASK = "task5_5"
EXPECT = r"ZeRO-3 all-reduced .* reduce_scatter_single gives it exactly that"


class AllGatherShard:
    @staticmethod
    def backward(ctx, grad):
        world_size, rank = dist.get_world_size(), dist.get_rank()
        flat = grad.reshape(-1).clone()
        dist.all_reduce(flat)
        size = shard_size(flat.numel(), world_size)
        padded = torch.nn.functional.pad(flat, (0, world_size * size - flat.numel()))
        return padded[rank * size:(rank + 1) * size] / world_size, None
