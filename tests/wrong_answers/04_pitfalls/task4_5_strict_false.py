"""load_state_dict(strict=False): a checkpoint with missing keys loads silently."""

TASK = "task4_5"
EXPECT = r"expected a RuntimeError: load_state_dict is strict"


def load_checkpoint(path, model, device):
    import torch

    state = torch.load(path, map_location=device, weights_only=True)
    state = {key.removeprefix("module."): value for key, value in state.items()}
    model.load_state_dict(state, strict=False)
    return model
