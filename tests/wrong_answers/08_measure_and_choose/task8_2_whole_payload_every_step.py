"""Each of the 2 (W - 1) steps sends the whole payload instead of 1 / W of it."""

TASK = "task8_2"
EXPECT = r"each sending n / W bytes"


def predict_allreduce_seconds(num_bytes, world_size, alpha, beta):
    steps = 2 * (world_size - 1)
    return steps * alpha + steps * num_bytes * beta
