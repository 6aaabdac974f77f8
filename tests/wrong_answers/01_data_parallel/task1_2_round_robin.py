"""Deals the samples out round-robin (batch[i::n]), as DistributedSampler does, not in blocks."""

TASK = "task1_2"
EXPECT = r"chunk 0 of a batch of 12 on 3 replicas \(it should hold samples 0\.\.3, in order\)"


def scatter(batch, num_replicas):
    sizes = scatter_sizes(batch.shape[0], num_replicas)
    return [batch[i::num_replicas] for i in range(len(sizes))]
