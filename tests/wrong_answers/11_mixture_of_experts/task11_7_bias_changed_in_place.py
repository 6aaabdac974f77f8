"""Updates the bias in place and returns it: the caller's old bias is gone."""

TASK = "task11_7"
EXPECT = r"changed bias itself"
REPLACE = {"update_bias": [
    ("    return bias + rate * torch.sign(load.mean() - load).to(bias.dtype)",
     "    return bias.add_(rate * torch.sign(load.mean() - load).to(bias.dtype))"),
]}
