"""A plain softmax and logsumexp: a row that sees no key of the block becomes 0/0, NaN."""

TASK = "task10_3"
EXPECT = r"NaN"


def attend_block(q, k, v, q_positions, k_positions, causal=True, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        visible = k_positions[None, :] <= q_positions[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)
