"""Tensor parallel only: the dp rows train on their halves and never average their gradients."""

TASK = "task6_5"
EXPECT = r"lives on \('tp',\), expected the 2-D mesh"


def parallelize_2d(model, mesh):
    if mesh.ndim != 2 or mesh.mesh_dim_names != ("dp", "tp"):
        raise ValueError("parallelize_2d needs a 2-D mesh named ('dp', 'tp')")
    return parallelize_gpt(model, mesh["tp"])
