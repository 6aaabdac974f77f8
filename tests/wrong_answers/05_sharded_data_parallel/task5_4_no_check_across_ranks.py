"""Shards without comparing the ranks' models: a rank with another model hangs training later."""

TASK = "task5_4"
EXPECT = r"shard_model returned although rank 1.s model differs from rank 0.s \(one more block"


def shard_model(model, reshard_after_forward=True, mp_policy=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = mp_policy or MixedPrecisionPolicy()
    mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model
