"""zero_grad() clears only the parameters' gradients: the reduced pieces of a backward that was
meant to be thrown away still count at the next step."""

TASK = "task5_3"
EXPECT = r"thrown away with zero_grad\(\).*the pieces' \.grad as well"


class Zero2Optimizer:
    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.params:
            param.grad = None
