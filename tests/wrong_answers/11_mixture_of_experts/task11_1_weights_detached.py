"""Routes under torch.no_grad(): the right numbers, but the router never learns from the
weights it gave."""

TASK = "task11_1"
EXPECT = r"the weights are not differentiable with respect to logits"
REPLACE = {"route": [
    ("    probs = logits.softmax(dim=-1)\n", "    probs = logits.detach().softmax(dim=-1)\n"),
]}
