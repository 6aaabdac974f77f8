"""Moves every bias, an expert at exactly the mean load counted as overloaded."""

TASK = "task11_7"
EXPECT = r"exactly the mean load"
REPLACE = {"update_bias": [
    ("    return bias + rate * torch.sign(load.mean() - load).to(bias.dtype)",
     "    return bias + rate * torch.where(load < load.mean(), 1.0, -1.0).to(bias.dtype)"),
]}
