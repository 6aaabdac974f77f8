"""Reduce-scatters but never divides by the world size: a sum of the ranks, not DDP's mean."""

TASK = "task5_2"
EXPECT = r"2x the expected one.*without dividing"


def reduce_scatter_mean(tensor):
    world_size = dist.get_world_size()
    flat = tensor.reshape(-1)
    size = shard_size(flat.numel(), world_size)
    padded = torch.nn.functional.pad(flat, (0, world_size * size - flat.numel()))
    mine = torch.empty(size, dtype=flat.dtype, device=flat.device)
    reduce_scatter_single(mine, padded)
    return mine
