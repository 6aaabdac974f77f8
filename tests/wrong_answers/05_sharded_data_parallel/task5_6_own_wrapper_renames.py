"""Writes its own wrapper module around torch.utils.checkpoint.checkpoint, right in every step,
but the block becomes a submodule named `block`: every key of the state dict changes, and a
checkpoint saved without activation checkpointing no longer loads."""

TASK = "task5_6"
EXPECT = r"after checkpoint_blocks the state dict has .*block.*no longer loads"


def checkpoint_blocks(model, every=1):
    import torch
    from torch import nn

    class Checkpointed(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)

    if every < 1:
        raise ValueError(f"every must be 1 or more, not {every}")
    for index in range(every - 1, len(model.blocks), every):
        model.blocks[index] = Checkpointed(model.blocks[index])
    return model
