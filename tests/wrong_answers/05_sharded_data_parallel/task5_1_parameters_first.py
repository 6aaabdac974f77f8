"""Shards the parameters at stage 1 and the optimizer state last: ZeRO's order backwards."""

TASK = "task5_1"
EXPECT = r"does not shard the parameters|is whole, but stage 1 shards it"


def memory_per_rank(num_params, world_size, stage, param_bytes=4, grad_bytes=4,
                    optimizer_bytes=8):
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"no stage {stage}")
    if world_size < 1 or num_params < 0:
        raise ValueError("bad world size")
    shard = -(-num_params // world_size)
    parameters = (shard if stage >= 1 else num_params) * param_bytes
    gradients = (shard if stage >= 2 else num_params) * grad_bytes
    optimizer_state = (shard if stage >= 3 else num_params) * optimizer_bytes
    return {"parameters": parameters, "gradients": gradients, "optimizer_state": optimizer_state,
            "total": parameters + gradients + optimizer_state}
