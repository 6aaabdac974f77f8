"""Waits for its receives with no timeout of its own: a mismatch waits for gloo's."""

TASK = "task7_2"
EXPECT = r"should end in StageRunner's own TimeoutError"


class StageRunner:
    def _receive(self, source, what, send=None):
        buffer = torch.empty(self.activation_shape, device=self.device)
        if send is None:
            dist.recv(buffer, src=source)
        else:
            for work in dist.batch_isend_irecv([send, dist.P2POp(dist.irecv, buffer, source)]):
                work.wait()
        return buffer
