"""Splits each block's MLP and forgets its attention: every rank keeps all of the heads."""

TASK = "task6_3"
EXPECT = r"keeps \d+ parameters of a block, expected \d+"


def tensor_parallel_blocks(model, group=None):
    for block in model.blocks:
        block.mlp = TensorParallelMLP(block.mlp, group)
    return model
