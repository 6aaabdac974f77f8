"""AllGatherSequence's backward forgets the group: its reduce-scatter (and the size it expects)
run over every rank of the job, so in a subgroup the gradient sums other groups' ranks and has
the wrong size."""

TASK = "task10_1"
EXPECT = r"input gradient with group=.*the backward failed.*must run in the group too"
REPLACE = {"AllGatherSequence": [
    ("        mine = whole.new_empty((whole.shape[0] // dist.get_world_size(ctx.group),\n",
     "        mine = whole.new_empty((whole.shape[0] // dist.get_world_size(),\n"),
    ("        reduce_scatter_single(mine, whole, group=ctx.group)\n",
     "        reduce_scatter_single(mine, whole)\n"),
]}
