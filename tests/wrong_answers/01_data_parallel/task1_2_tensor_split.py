"""Cuts the batch with torch.tensor_split, which splits evenly, instead of scatter_sizes' chunks."""

TASK = "task1_2"
EXPECT = r"chunk 1 of a batch of 10 on 3 replicas \(it should hold samples 4\.\.7, in order\): shape \(3, 2\), expected \(4, 2\)|DataParallel makes \d chunks"


def scatter(batch, num_replicas):
    return list(torch.tensor_split(batch, num_replicas))
