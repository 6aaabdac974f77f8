"""All-reduces the replicated gradients and stops there: all_reduce sums (its default op is SUM),
so every replicated gradient is W times the mean."""

TASK = "task11_5"
EXPECT = r"rank 0: ep 2, case 0: replicated parameter 0's gradient .*: that is the sum over the group, not the mean"
REPLACE = {"sync_gradients": [
    ("        dist.all_reduce(parameter.grad, group=group)\n"
     "        parameter.grad.div_(world)\n",
     "        dist.all_reduce(parameter.grad, group=group)\n"),
]}
