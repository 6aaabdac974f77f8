"""Waits for its all-reduce inside the hook and returns a finished future: the backward stops
at every bucket instead of going on while the bucket travels."""

TASK = "task8_3"
EXPECT = r"not started with async_op=True"


def bf16_compress(state, bucket):
    group = state if state is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    dist.all_reduce(compressed, group=group)
    buffer.copy_(compressed)
    done = torch.futures.Future()
    done.set_result(buffer)
    return done
