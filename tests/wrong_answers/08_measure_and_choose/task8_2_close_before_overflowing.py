"""Closes a bucket before the parameter that would take it past its limit, so that no bucket
ever exceeds it; DDP adds the parameter first and closes the bucket after."""

TASK = "task8_2"
EXPECT = r"torch assigns"


def ddp_buckets(param_bytes, bucket_cap_bytes, first_bucket_bytes):
    buckets, current, size = [], [], 0
    for index, nbytes in enumerate(param_bytes):
        limit = first_bucket_bytes if not buckets else bucket_cap_bytes
        if current and size + nbytes > limit:
            buckets.append(current)
            current, size = [], 0
        current.append(index)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
