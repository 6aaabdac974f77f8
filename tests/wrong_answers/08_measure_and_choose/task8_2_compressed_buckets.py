"""Forms the buckets from the compressed sizes (2 bytes per element under a bf16 hook): DDP forms
them from the gradients' own sizes, so the buckets come out twice as large."""

TASK = "task8_2"
EXPECT = r"a real DDP builds"


def predict_ddp_comm_seconds(model, world_size, alpha, beta, bucket_cap_mb=None,
                             bytes_per_element=None):
    params = [p for p in model.parameters() if p.requires_grad][::-1]
    sizes = [p.numel() * (bytes_per_element or p.element_size()) for p in params]
    if bucket_cap_mb is None:
        cap, first = DEFAULT_BUCKET_CAP_MB * MiB, FIRST_BUCKET_BYTES
    else:
        cap = first = int(bucket_cap_mb * MiB)
    buckets = ddp_buckets(sizes, int(cap), first)
    return sum(predict_allreduce_seconds(sum(sizes[i] for i in bucket), world_size, alpha, beta)
               for bucket in buckets)
