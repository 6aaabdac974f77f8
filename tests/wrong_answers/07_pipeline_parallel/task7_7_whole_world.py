"""All-reduces over the default group, the whole world, where the other ranks hold other
stages, then divides by the number of copies."""

TASK = "task7_7"
EXPECT = r"whole world, whose other ranks hold other stages"
REPLACE = {"average_over_copies": [("dist.all_reduce(parameter.grad, group=group)",
                                    "dist.all_reduce(parameter.grad)")]}
