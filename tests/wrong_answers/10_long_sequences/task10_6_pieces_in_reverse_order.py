"""Joins the received pieces last rank first."""

TASK = "task10_6"
EXPECT = r"reverse rank order"
REPLACE = {"SeqAllToAll": [
    ("torch.cat(received.unbind(0), dim=gather_dim)",
     "torch.cat(received.unbind(0)[::-1], dim=gather_dim)"),
]}
