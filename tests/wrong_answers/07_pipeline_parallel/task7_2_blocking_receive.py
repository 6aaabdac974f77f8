"""Receives with a blocking dist.recv and no timeout of its own: a mismatch waits for gloo's."""

TASK = "task7_2"
EXPECT = r"should end in StageRunner's own TimeoutError"


class StageRunner:
    def _receive(self, source, what):
        buffer = torch.empty(self.activation_shape, device=self.device)
        dist.recv(buffer, src=source)
        return buffer
