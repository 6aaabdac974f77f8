"""Compresses and all-reduces, but never divides by the world size: the gradients are summed
over the ranks, W times DDP's average."""

TASK = "task8_3"
EXPECT = r"far more than bf16's rounding; was the bucket divided by the world size"


def bf16_compress(state, bucket):
    import torch
    import torch.distributed as dist

    group = state if state is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16)
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(done):
        buffer.copy_(done.value()[0])
        return buffer

    return future.then(decompress)
