"""All-gathers every rank's keys and values and attends once: right numbers, and the whole
sequence's keys and scores on every rank, which is what ring attention avoids."""

TASK = "task10_5"
EXPECT = r"called ring_pass 0 time|built a tensor of"


def ring_attention(q, k, v, positions, group=None, causal=True):
    world = dist.get_world_size(group)
    gathered = []
    for t in (k, v, positions):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous(), group=group)
        parts[dist.get_rank(group)] = t  # its own, as given: the gradient reaches it
        gathered.append(torch.cat(parts, dim=-2 if t.dim() > 1 else 0))
    return attend_block(q, gathered[0], gathered[1], positions, gathered[2], causal)
