"""Keeps the reentrant checkpoint and works around its frozen-embeddings failure the way some
libraries do, by making each checkpointed block's input need a gradient: backward() then
reaches every parameter, but torch.autograd.grad (or backward(inputs=...)) is refused."""

TASK = "task5_6"
EXPECT = r"torch.autograd.grad through the checkpointed blocks raised.*reentrant"


def checkpoint_blocks(model, every=1):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    def input_needs_grad(module, args):
        if not args[0].requires_grad:
            return (args[0].detach().requires_grad_(),) + tuple(args[1:])
        return None

    if every < 1:
        raise ValueError(f"every must be 1 or more, not {every}")
    for index in range(every - 1, len(model.blocks), every):
        wrapped = checkpoint_wrapper(model.blocks[index], checkpoint_impl=CheckpointImpl.REENTRANT)
        wrapped.register_forward_pre_hook(input_needs_grad)
        model.blocks[index] = wrapped
    return model
