"""SeqAllToAll's backward repeats the forward's exchange instead of reversing it: the gradient
is cut along scatter_dim again and never goes home."""

TASK = "task10_6"
EXPECT = r"the exchange the other way round"
REPLACE = {"SeqAllToAll": [
    ("SeqAllToAll.apply(grad, gather_dim, scatter_dim, ctx.group)",
     "SeqAllToAll.apply(grad, scatter_dim, gather_dim, ctx.group)"),
]}
