"""Averages an expert's gradient over its copies, as DDP would: but each copy saw only the tokens
of its own expert-parallel group, so the mean over the copies is ep times the gradient of the
mean of the ranks' losses; the sum over the copies divided by every rank is that gradient."""

TASK = "task11_5"
EXPECT = r"rank 0: ep 2, case 0: expert parameter 0's gradient should be .*: that is the mean over the copies"
REPLACE = {"sync_gradients": [
    ("            dist.all_reduce(parameter.grad, group=copies)\n"
     "        parameter.grad.div_(world)",
     "            dist.all_reduce(parameter.grad, group=copies)\n"
     "        parameter.grad.div_(dist.get_world_size(copies) if copies is not None else 1)"),
]}
