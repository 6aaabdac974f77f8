"""Sends the rows with dist.all_to_all_single itself: the forward is right, but the collective
has no autograd, so no gradient reaches the tokens (nor the router behind them)."""

TASK = "task11_4"
EXPECT = r"no gradient reached tokens|the output is not differentiable"
REPLACE = {"expert_parallel_forward": [
    ("    arrived = AllToAll.apply(tokens[order // k], send, receive, group)  # by source rank\n",
     "    arrived = tokens.new_empty((sum(receive), tokens.shape[-1]))\n"
     "    dist.all_to_all_single(arrived, tokens[order // k].detach(), output_split_sizes=receive,\n"
     "                           input_split_sizes=send, group=group)\n"),
]}
