"""Never passes reshard_after_forward on: the blocks always get FSDP's default."""

TASK = "task5_4"
EXPECT = r"gathered again for backward although reshard_after_forward=False"


def shard_model(model, reshard_after_forward=True, mp_policy=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, shapes)
    for rank, theirs in enumerate(every_rank):
        if theirs != every_rank[0]:
            raise ValueError(f"rank {rank} holds another model than rank 0")
    mp_policy = mp_policy or MixedPrecisionPolicy()
    mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model
