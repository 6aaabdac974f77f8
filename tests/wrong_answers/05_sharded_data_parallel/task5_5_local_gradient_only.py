"""Backward hands the piece its own slice of this rank's gradient, reduced with nobody."""

TASK = "task5_5"
EXPECT = r"that is this rank's own gradient"


class AllGatherShard:
    @staticmethod
    def backward(ctx, grad):
        world_size, rank = dist.get_world_size(), dist.get_rank()
        flat = grad.reshape(-1)
        size = shard_size(flat.numel(), world_size)
        padded = torch.nn.functional.pad(flat, (0, world_size * size - flat.numel()))
        return padded[rank * size:(rank + 1) * size], None
