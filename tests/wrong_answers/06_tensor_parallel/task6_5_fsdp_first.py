"""FSDP first, then tensor parallelism on parameters that are already DTensors."""

TASK = "task6_5"
EXPECT = r"parallelize_2d on a dp 2 x tp 2 mesh raised|expected the 2-D mesh|differ"


def parallelize_2d(model, mesh):
    if mesh.ndim != 2 or mesh.mesh_dim_names != ("dp", "tp"):
        raise ValueError("parallelize_2d needs a 2-D mesh named ('dp', 'tp')")
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    parallelize_gpt(model, mesh["tp"])
    return model
