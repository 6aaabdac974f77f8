"""Counts every target, ignored ones included, as a token."""

TASK = "task10_7"
EXPECT = r"ignored ones included"
REPLACE = {"token_mean_loss": [
    ("    real = (targets != ignore_index).sum()\n",
     "    real = torch.tensor(targets.numel())\n"),
]}
