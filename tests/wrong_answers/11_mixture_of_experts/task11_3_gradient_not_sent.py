"""The backward returns the gradient as it arrived, without sending it home: right only on one
rank, and only when the sizes agree."""

TASK = "task11_3"
EXPECT = r"(gradient of x|no gradient reached x|the backward called \[\])"
REPLACE = {"AllToAll": [
    ("        back = grad.new_empty((sum(send_sizes), *grad.shape[1:]))\n"
     "        dist.all_to_all_single(back, grad.contiguous(), output_split_sizes=send_sizes,\n"
     "                               input_split_sizes=receive_sizes, group=ctx.group)\n",
     "        back = grad\n"),
]}
