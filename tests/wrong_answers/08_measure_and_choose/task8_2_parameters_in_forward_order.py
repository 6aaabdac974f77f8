"""Buckets the parameters in the model's order; DDP takes them last first, the order in which
the backward produces their gradients."""

TASK = "task8_2"
EXPECT = r"buckets the parameters in the model's order predicts; DDP takes them last first"


def predict_ddp_comm_seconds(model, world_size, alpha, beta, bucket_cap_mb=None,
                             bytes_per_element=None):
    params = [p for p in model.parameters() if p.requires_grad]
    sizes = [p.numel() * p.element_size() for p in params]
    if bucket_cap_mb is None:
        cap, first = DEFAULT_BUCKET_CAP_MB * MiB, FIRST_BUCKET_BYTES
    else:
        cap = first = int(bucket_cap_mb * MiB)
    buckets = ddp_buckets(sizes, int(cap), first)
    total = 0.0
    for bucket in buckets:
        nbytes = sum(params[i].numel() * (bytes_per_element or params[i].element_size())
                     for i in bucket)
        total += predict_allreduce_seconds(nbytes, world_size, alpha, beta)
    return total
