"""Shards every block and forgets the root: embeddings and head are never averaged."""

TASK = "task6_5"
EXPECT = r"the model itself is not an FSDP module"


def parallelize_2d(model, mesh):
    if mesh.ndim != 2 or mesh.mesh_dim_names != ("dp", "tp"):
        raise ValueError("parallelize_2d needs a 2-D mesh named ('dp', 'tp')")
    parallelize_gpt(model, mesh["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    return model
