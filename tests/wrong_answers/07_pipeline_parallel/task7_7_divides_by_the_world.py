"""Divides by the world's size, as lesson 03's DDP average does, not by the number of copies."""

TASK = "task7_7"
EXPECT = r"divided by the world's size \(or averaged twice\), not once by the number of copies"
REPLACE = {"average_over_copies": [("parameter.grad /= copies.size()",
                                    "parameter.grad /= dist.get_world_size()")]}
