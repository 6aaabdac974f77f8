"""Runs the experts one by one in a loop over their groups instead of one grouped multiply per
weight: the right numbers, but not the grouped kernel the task is about."""

TASK = "task11_6"
EXPECT = r"called grouped_matmul 0 times"
REPLACE = {"grouped_experts": [
    ("    hidden = torch.nn.functional.gelu(grouped_matmul(x, w_in, offs))\n"
     "    done = grouped_matmul(hidden, w_out, offs)[rows]",
     "    ends = offs.tolist()\n"
     "    done = torch.cat([torch.nn.functional.gelu(x[a:b] @ w_in[e]) @ w_out[e] for e, (a, b)\n"
     "                      in enumerate(zip([0] + ends, ends))])[rows]"),
]}
