"""Divides the experts' gradients by W but never adds the other copies' in: with data parallel
experts, each copy keeps only its own expert-parallel group's share and the copies drift
apart."""

TASK = "task11_5"
EXPECT = r"rank 0: dp 2, every rank a copy, case 0: expert parameter 0's gradient .*the copies were not summed"
REPLACE = {"sync_gradients": [
    ("        if copies is not None:\n"
     "            dist.all_reduce(parameter.grad, group=copies)\n", ""),
]}
