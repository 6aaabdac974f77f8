"""Steps the bias by rate x (mean load - load), the size of the error, instead of rate x its
sign."""

TASK = "task11_7"
EXPECT = r"the size of the error"
REPLACE = {"update_bias": [
    ("    return bias + rate * torch.sign(load.mean() - load).to(bias.dtype)",
     "    return bias + rate * (load.mean() - load).to(bias.dtype)"),
]}
