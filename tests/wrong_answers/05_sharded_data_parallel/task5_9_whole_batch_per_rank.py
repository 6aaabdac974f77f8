"""Counts the activations of the whole batch on every rank, not of its share of it."""

TASK = "task5_9"
EXPECT = r"activations of the whole batch: a rank.s batch is batch_size // world_size"
REPLACE = {"peak_bytes": [("activations = activation_bytes(config, batch_size // world_size, "
                           "checkpoint)", "activations = activation_bytes(config, batch_size, "
                           "checkpoint)")]}
