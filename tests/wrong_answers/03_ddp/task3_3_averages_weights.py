"""All-reduces the parameters (the weights) instead of their gradients."""

TASK = "task3_3"
EXPECT = r"kept its own gradient"


def average_gradients(model):
    import torch
    import torch.distributed as dist

    with torch.no_grad():
        for param in model.parameters():
            dist.all_reduce(param.data)
            param.data /= dist.get_world_size()
