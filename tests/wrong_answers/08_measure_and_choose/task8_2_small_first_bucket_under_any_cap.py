"""Keeps a 1 MiB first bucket whatever cap is given: DDP does that only when bucket_cap_mb is left
unset, so a cap of 1000 MiB is predicted as two buckets where DDP builds one."""

TASK = "task8_2"
EXPECT = r"a 1 MiB first bucket predicts; DDP keeps its small first bucket only when"


def predict_ddp_comm_seconds(model, world_size, alpha, beta, bucket_cap_mb=None,
                             bytes_per_element=None):
    params = [p for p in model.parameters() if p.requires_grad][::-1]
    sizes = [p.numel() * p.element_size() for p in params]
    cap = DEFAULT_BUCKET_CAP_MB * MiB if bucket_cap_mb is None else bucket_cap_mb * MiB
    buckets = ddp_buckets(sizes, int(cap), FIRST_BUCKET_BYTES)
    total = 0.0
    for bucket in buckets:
        nbytes = sum(params[i].numel() * (bytes_per_element or params[i].element_size())
                     for i in bucket)
        total += predict_allreduce_seconds(nbytes, world_size, alpha, beta)
    return total
