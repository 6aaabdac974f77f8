"""Sends the gradients back with the forward's split sizes: each gradient lands on the wrong
rank, or autograd refuses its shape."""

TASK = "task11_3"
EXPECT = r"(gradient of x|no gradient reached x)"
REPLACE = {"AllToAll": [
    ("        back = grad.new_empty((sum(send_sizes), *grad.shape[1:]))\n"
     "        dist.all_to_all_single(back, grad.contiguous(), output_split_sizes=send_sizes,\n"
     "                               input_split_sizes=receive_sizes, group=ctx.group)\n",
     "        back = grad.new_empty((sum(receive_sizes), *grad.shape[1:]))\n"
     "        dist.all_to_all_single(back, grad.contiguous(), output_split_sizes=receive_sizes,\n"
     "                               input_split_sizes=send_sizes, group=ctx.group)\n"),
]}
