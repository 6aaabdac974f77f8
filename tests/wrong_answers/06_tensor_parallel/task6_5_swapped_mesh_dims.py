"""Tensor parallel across the dp dimension, FSDP across tp: the split ranks read different data."""

TASK = "task6_5"
EXPECT = r"expected the 2-D mesh \('dp', 'tp'\)|differ"


def parallelize_2d(model, mesh):
    if mesh.ndim != 2 or mesh.mesh_dim_names != ("dp", "tp"):
        raise ValueError("parallelize_2d needs a 2-D mesh named ('dp', 'tp')")
    parallelize_gpt(model, mesh["dp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["tp"])
    fully_shard(model, mesh=mesh["tp"])
    return model
