"""fully_shard on the root only: right numbers, but every forward gathers the whole model."""

TASK = "task6_5"
EXPECT = r"the blocks are not FSDP modules"


def parallelize_2d(model, mesh):
    if mesh.ndim != 2 or mesh.mesh_dim_names != ("dp", "tp"):
        raise ValueError("parallelize_2d needs a 2-D mesh named ('dp', 'tp')")
    parallelize_gpt(model, mesh["tp"])
    fully_shard(model, mesh=mesh["dp"])
    return model
