"""No check of the mesh: a 1-D mesh fails deep inside torch, with torch's own words."""

TASK = "task6_5"
EXPECT = r"parallelize_2d on a 1-D mesh gave .*raise ValueError"


def parallelize_2d(model, mesh):
    parallelize_gpt(model, mesh["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model
