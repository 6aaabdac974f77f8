"""Loads a DDP checkpoint without stripping the 'module.' prefix from its keys."""

TASK = "task4_5"
EXPECT = r"strip the leading 'module.'"


def load_checkpoint(path, model, device):
    import torch

    model.load_state_dict(torch.load(path, map_location=device, weights_only=True))
    return model
