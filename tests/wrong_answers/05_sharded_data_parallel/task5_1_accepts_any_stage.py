"""Treats every stage above 3 as stage 3 instead of refusing it."""

TASK = "task5_1"
EXPECT = r"raise ValueError, there are stages 0 to 3"


def memory_per_rank(num_params, world_size, stage, param_bytes=4, grad_bytes=4,
                    optimizer_bytes=8):
    shard = -(-num_params // max(world_size, 1))
    parameters = (shard if stage >= 3 else num_params) * param_bytes
    gradients = (shard if stage >= 2 else num_params) * grad_bytes
    optimizer_state = (shard if stage >= 1 else num_params) * optimizer_bytes
    return {"parameters": parameters, "gradients": gradients, "optimizer_state": optimizer_state,
            "total": parameters + gradients + optimizer_state}
