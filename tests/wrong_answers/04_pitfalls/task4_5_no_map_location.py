"""Loads without map_location, so tensors saved on cuda:0 go back to cuda:0."""

TASK = "task4_5"
EXPECT = r"map_location"


def load_checkpoint(path, model, device):
    import torch

    state = torch.load(path, weights_only=True)
    state = {key.removeprefix("module."): value for key, value in state.items()}
    model.load_state_dict(state)
    return model.to(device)
