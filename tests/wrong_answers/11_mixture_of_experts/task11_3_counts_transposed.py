"""Views the received counts the other way round: column s is rank s's."""

TASK = "task11_3"
EXPECT = r"the shape is transposed; row s is rank s's"
REPLACE = {"exchange_counts": [
    ("    return received.view(world, -1)", "    return received.view(world, -1).t()"),
]}
