"""Gives each rank a contiguous block of the order instead of every num_replicas-th index."""

TASK = "task3_1"
EXPECT = r"contiguous block"


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
        per_rank = dataset_len // num_replicas
        order = order[: per_rank * num_replicas]
    else:
        per_rank = math.ceil(dataset_len / num_replicas)
        padding = per_rank * num_replicas - dataset_len
        order += (order * math.ceil(padding / max(dataset_len, 1)))[:padding]
    return order[rank * per_rank:(rank + 1) * per_rank]
