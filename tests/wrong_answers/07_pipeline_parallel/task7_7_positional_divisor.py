"""Divides by the mesh's second dimension, taking it for "dp" whatever the mesh's names say."""

TASK = "task7_7"
EXPECT = r"the average over its stage's \d+ copies is"
REPLACE = {"average_over_copies": [("parameter.grad /= copies.size()",
                                    "parameter.grad /= mesh.size(1)")]}
