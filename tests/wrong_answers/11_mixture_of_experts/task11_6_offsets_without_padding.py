"""Pads the groups in the buffer but gives grouped_matmul the unpadded ends (the running sum of
the counts): every group after the first starts at the wrong row."""

TASK = "task11_6"
EXPECT = r"end the groups without their padding"
REPLACE = {"grouped_experts": [
    ("    offs = torch.cumsum(padded, dim=0).to(torch.int32)\n",
     "    offs = torch.cumsum(counts, dim=0).to(torch.int32)\n"),
]}
