"""Checks that the mesh is 2-D but not its names: a mesh named ('data', 'model') fails inside
torch with a KeyError."""

TASK = "task6_5"
EXPECT = r"mesh named \('data', 'model'\) gave KeyError.*check its mesh_dim_names too"


def parallelize_2d(model, mesh):
    if mesh.ndim != 2:
        raise ValueError(f"parallelize_2d needs a 2-D mesh named ('dp', 'tp'), got "
                         f"{mesh.ndim}-D {mesh.mesh_dim_names}")
    parallelize_gpt(model, mesh["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model
