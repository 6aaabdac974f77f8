"""Averages the fp32 bucket as it is: right gradients, but nothing saved on the wire."""

TASK = "task8_3"
EXPECT = r"all-reduced tensors of \['torch.float32'\]: compress the bucket to torch.bfloat16"


def bf16_compress(state, bucket):
    import torch.distributed as dist

    group = state if state is not None else dist.group.WORLD
    buffer = bucket.buffer().div_(dist.get_world_size(group))
    future = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    return future.then(lambda done: done.value()[0])
