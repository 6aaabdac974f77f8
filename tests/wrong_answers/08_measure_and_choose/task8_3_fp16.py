"""Compresses to float16: the same 2 bytes, but not bf16's range (fp16 overflows above 65504;
DDP's fp16 hook exists for GPUs without bf16)."""

TASK = "task8_3"
EXPECT = r"all-reduced tensors of \['torch.float16'\]"


def bf16_compress(state, bucket):
    import torch
    import torch.distributed as dist

    group = state if state is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.float16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(done):
        buffer.copy_(done.value()[0])
        return buffer

    return future.then(decompress)
