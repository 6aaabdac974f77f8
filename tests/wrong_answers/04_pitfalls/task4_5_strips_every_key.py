"""Cuts the first 7 characters off every key, also from checkpoints without 'module.'."""

TASK = "task4_5"
EXPECT = r"plain checkpoint .*only from keys that start with it"


def load_checkpoint(path, model, device):
    import torch

    state = torch.load(path, map_location=device, weights_only=True)
    model.load_state_dict({key[len("module."):]: value for key, value in state.items()})
    return model
