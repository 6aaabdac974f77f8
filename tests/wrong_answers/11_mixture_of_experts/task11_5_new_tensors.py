"""Puts a new tensor in each .grad (``p.grad = p.grad / world``) instead of dividing in place:
the values are right, but whatever holds the gradient tensor itself (a view into one flat
buffer, as DDP's ``gradient_as_bucket_view=True`` makes) keeps the unsynchronised values."""

TASK = "task11_5"
EXPECT = r"dp 2 x ep 2, rank 0, case 0: a parameter's .grad is another tensor"
REPLACE = {"sync_gradients": [
    ("        parameter.grad.div_(world)\n    for parameter in experts:",
     "        parameter.grad = parameter.grad / world\n    for parameter in experts:"),
]}
