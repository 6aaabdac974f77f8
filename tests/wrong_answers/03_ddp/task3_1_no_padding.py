"""Never pads: when the length does not divide, some ranks get one index fewer."""

TASK = "task3_1"
EXPECT = r"no padding"


def shard_indices(dataset_len, num_replicas, rank, shuffle=True, seed=0, epoch=0,
                  drop_last=False):
    import torch

    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        order = torch.randperm(dataset_len, generator=generator).tolist()
    else:
        order = list(range(dataset_len))
    if drop_last:
        order = order[: (dataset_len // num_replicas) * num_replicas]
    return order[rank::num_replicas]
