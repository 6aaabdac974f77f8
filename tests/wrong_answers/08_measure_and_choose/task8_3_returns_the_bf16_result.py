"""Returns the all-reduced bf16 tensor itself instead of copying it into the bucket's buffer:
DDP copies it into the gradients anyway, but a second bucket-sized tensor lives until then."""

TASK = "task8_3"
EXPECT = r"the hook's future holds a new torch.bfloat16 tensor, not the bucket's buffer"


def bf16_compress(state, bucket):
    group = state if state is not None else dist.group.WORLD
    compressed = bucket.buffer().to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()
    return future.then(lambda done: done.value()[0])
