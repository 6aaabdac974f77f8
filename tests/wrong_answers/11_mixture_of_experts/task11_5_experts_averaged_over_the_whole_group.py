"""All-reduces the experts' gradients over every rank like the replicated ones: but rank 0's
first expert and rank 1's first expert are different experts, so this adds other experts'
gradients into each rank's own."""

TASK = "task11_5"
EXPECT = r"rank 0: ep 2, case 0: expert parameter 0's gradient .*the mean over the whole group: that mixes"
REPLACE = {"sync_gradients": [
    ("        if copies is not None:\n"
     "            dist.all_reduce(parameter.grad, group=copies)\n",
     "        dist.all_reduce(parameter.grad, group=group)\n"),
]}
