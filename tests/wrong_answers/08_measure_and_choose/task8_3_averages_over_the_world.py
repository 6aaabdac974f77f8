"""Ignores the process group DDP hands the hook and averages over the whole world: a DDP over a
subgroup (one replica group of an HSDP or TP x DP job) gets everyone's gradients."""

TASK = "task8_3"
EXPECT = r"that is the mean over all 4 ranks; all-reduce over state"


def bf16_compress(state, bucket):
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    future = dist.all_reduce(compressed, async_op=True).get_future()

    def decompress(done):
        buffer.copy_(done.value()[0])
        return buffer

    return future.then(decompress)
