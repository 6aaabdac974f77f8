"""Removes every 'module.' in a key (str.replace), not only DDP's leading one: a model whose own
submodule is called 'module' loses it too."""

TASK = "task4_5"
EXPECT = r"strip the leading 'module\.' once, not every 'module\.' in the key"


def load_checkpoint(path, model, device):
    import torch

    state = torch.load(path, map_location=device, weights_only=True)
    model.load_state_dict({key.replace("module.", ""): value for key, value in state.items()})
    return model
