"""Raises an overloaded expert's bias and lowers an underloaded one's: the update's sign
reversed, which makes the busy experts busier."""

TASK = "task11_7"
EXPECT = r"signs are reversed"
REPLACE = {"update_bias": [
    ("    return bias + rate * torch.sign(load.mean() - load).to(bias.dtype)",
     "    return bias + rate * torch.sign(load - load.mean()).to(bias.dtype)"),
]}
