"""Backward returns the summed piece, never divided by the world size."""

TASK = "task5_5"
EXPECT = r"gradient of rank \d's piece.*2x the expected one.*without dividing"


class AllGatherShard:
    @staticmethod
    def backward(ctx, grad):
        world_size = dist.get_world_size()
        flat = grad.reshape(-1)
        padded = torch.nn.functional.pad(flat, (0, world_size * ctx.size - flat.numel()))
        mine = torch.empty(ctx.size, dtype=grad.dtype, device=grad.device)
        reduce_scatter_single(mine, padded)
        return mine, None
