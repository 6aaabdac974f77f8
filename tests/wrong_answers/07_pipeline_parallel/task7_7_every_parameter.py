"""All-reduces every parameter's gradient, one without a gradient too."""

TASK = "task7_7"
EXPECT = r"a parameter without a gradient \(grad None\) is skipped"
REPLACE = {"average_over_copies": [("        if parameter.grad is not None:\n", "        if True:\n")]}
