"""Compares how many parameters each rank has, not their shapes: a wider model slips through."""

TASK = "task5_4"
EXPECT = r"shard_model returned although rank 1's model differs from rank 0's \(wider"


def shard_model(model, reshard_after_forward=True, mp_policy=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, len(list(model.parameters())))
    for rank, count in enumerate(counts):
        if count != counts[0]:
            raise ValueError(f"rank {rank} holds another model than rank 0")
    mp_policy = mp_policy or MixedPrecisionPolicy()
    mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model
