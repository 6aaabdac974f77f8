"""Merges by concatenating the pieces in rank order: the chunks stay zig-zagged."""

TASK = "task10_4"
EXPECT = r"zigzag_merge of"


def zigzag_merge(pieces, dim):
    return torch.cat(list(pieces), dim=dim)
