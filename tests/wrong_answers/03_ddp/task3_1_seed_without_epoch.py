"""Seeds the shuffle with seed alone, so every epoch repeats epoch 0's order."""

TASK = "task3_1"
EXPECT = r"epoch 0 matches but epoch \d+ does not: is the order seeded with seed \+ epoch\?"


def shard_indices(dataset_len, num_replicas, rank, shuffle=True, seed=0, epoch=0,
                  drop_last=False):
    import math

    import torch

    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed)
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
    return order[rank::num_replicas]
