"""The all-reduce's bus bandwidth with the all-gather's factor, (W - 1) / W: it forgets that an
all-reduce is a reduce-scatter and an all-gather, each sending (W - 1) / W of the payload."""

TASK = "task8_1"
EXPECT = r"all_reduce on \d ranks: the bus bandwidth; the factor should be"


def bus_bandwidth(op, num_bytes, seconds, world_size):
    if op not in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        raise ValueError(op)
    if seconds <= 0 or num_bytes < 0 or world_size < 1:
        raise ValueError("bad measurement")
    algorithm = num_bytes / seconds
    factor = 1.0 if op == "broadcast" else (world_size - 1) / world_size
    return algorithm, algorithm * factor
