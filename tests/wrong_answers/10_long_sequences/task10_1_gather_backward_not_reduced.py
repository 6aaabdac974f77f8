"""AllGatherSequence's backward keeps this rank's slice of its own gradient: the other ranks'
parts of the layers that used these tokens are never added."""

TASK = "task10_1"
EXPECT = r"this rank's own gradient for its tokens"
REPLACE = {"AllGatherSequence": [
    ("        reduce_scatter_single(mine, whole, group=ctx.group)\n",
     "        mine = whole.chunk(dist.get_world_size(ctx.group))[dist.get_rank(ctx.group)]"
     ".clone()\n"),
]}
