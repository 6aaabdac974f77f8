"""Calls fully_shard on the whole model only: one group, gathered whole for every forward."""

TASK = "task5_4"
EXPECT = r"one group for the whole model"


def shard_model(model, reshard_after_forward=True, mp_policy=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    shapes = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, shapes)
    for rank, theirs in enumerate(every_rank):
        if theirs != every_rank[0]:
            raise ValueError(f"rank {rank} holds another model than rank 0")
    mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward,
                mp_policy=mp_policy or MixedPrecisionPolicy())
    return model
