"""Passes the ring W - 1 times but keeps every block it receives and attends once over all of
them: right numbers, and scores over the whole sequence's keys on every rank."""

TASK = "task10_5"
EXPECT = r"matrix product inside ring_attention built a tensor"


def ring_attention(q, k, v, positions, group=None, causal=True):
    block, blocks = [k, v, positions], [[k, v, positions]]
    for _ in range(dist.get_world_size(group) - 1):
        block = ring_pass(block, group)
        blocks.append(block)
    keys, values, key_positions = (torch.cat(parts, dim=-2 if parts[0].dim() > 1 else 0)
                                   for parts in zip(*blocks, strict=True))
    return attend_block(q, keys, values, positions, key_positions, causal)
