"""Pads by repeating the last index of the order, not the first ones as DistributedSampler does."""

TASK = "task3_1"
EXPECT = r"padding differs.*from the start"


def shard_indices(dataset_len, num_replicas, rank, shuffle=True, seed=0, epoch=0,
                  drop_last=False):
    import math

    import torch

    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        order = torch.randperm(dataset_len, generator=generator).tolist()
    else:
        order = list(range(dataset_len))
    if drop_last:
        order = order[: (dataset_len // num_replicas) * num_replicas]
    else:
        padding = math.ceil(dataset_len / num_replicas) * num_replicas - dataset_len
        order += order[-1:] * padding
    return order[rank::num_replicas]
