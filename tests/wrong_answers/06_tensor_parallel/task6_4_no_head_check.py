"""Trusts DTensor to refuse a split that does not divide; it shards unevenly instead."""

TASK = "task6_4"
EXPECT = r"parallelize_gpt accepted a size of 6 on 4 ranks|parallelize_gpt raised"


def parallelize_gpt(model, mesh):
    for block in model.blocks:
        parallelize_module(block, mesh, block_plan())
    return model
