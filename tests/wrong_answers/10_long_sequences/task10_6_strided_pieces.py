"""Cuts the pieces with a reshape to (n/W, W), so rank j gets entries j, j + W, j + 2W, ...:
every W-th head, not a contiguous block of them."""

TASK = "task10_6"
EXPECT = r"every W-th entry"
REPLACE = {"SeqAllToAll": [
    ("pieces = torch.stack(x.chunk(world, dim=scatter_dim))",
     "pieces = x.unflatten(scatter_dim, (-1, world)).movedim(scatter_dim % x.dim() + 1, 0)"
     ".contiguous()"),
]}
