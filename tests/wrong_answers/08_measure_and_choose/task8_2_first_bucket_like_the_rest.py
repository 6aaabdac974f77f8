"""Every bucket gets bucket_cap_bytes, the first one too."""

TASK = "task8_2"
EXPECT = r"torch assigns"


def ddp_buckets(param_bytes, bucket_cap_bytes, first_bucket_bytes):
    buckets, current, size = [], [], 0
    for index, nbytes in enumerate(param_bytes):
        current.append(index)
        size += nbytes
        if size >= bucket_cap_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets
