"""Hands all_to_all_single the gradient as autograd gave it: the backward works while the
gradient happens to be contiguous and raises when it is not."""

TASK = "task11_3"
EXPECT = r"no gradient reached x: .*contiguous.*send t\.contiguous\(\)"
REPLACE = {"AllToAll": [
    ("        dist.all_to_all_single(back, grad.contiguous(), output_split_sizes=send_sizes,\n",
     "        dist.all_to_all_single(back, grad, output_split_sizes=send_sizes,\n"),
]}
