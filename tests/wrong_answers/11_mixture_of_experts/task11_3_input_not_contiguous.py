"""Hands all_to_all_single the rows as the caller gave them: the forward works on a contiguous
x and raises on any other layout."""

TASK = "task11_3"
EXPECT = r"AllToAll\.apply raised \w+Error: .*contiguous.*send t\.contiguous\(\)"
REPLACE = {"AllToAll": [
    ("        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=receive_sizes,\n",
     "        dist.all_to_all_single(out, x, output_split_sizes=receive_sizes,\n"),
]}
