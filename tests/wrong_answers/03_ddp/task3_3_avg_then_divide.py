"""All-reduces with ReduceOp.AVG and then divides by the world size again."""

TASK = "task3_3"
EXPECT = r"averaged gradient .* differ.*once too often"


def average_gradients(model):
    import torch.distributed as dist

    world_size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
            param.grad /= world_size
