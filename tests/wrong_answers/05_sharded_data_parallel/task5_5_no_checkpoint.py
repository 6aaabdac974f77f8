"""Gathers and runs each block without checkpointing: autograd keeps every gathered parameter."""

TASK = "task5_5"
EXPECT = r"still held .* autograd saved them for backward"


class Zero3Blocks:
    def forward(self, x):
        first = 0
        for index in range(len(self.blocks)):
            count = len(self.names[index])
            x = self._gather_and_run(index, x, *list(self.shards)[first:first + count])
            first += count
        return x
