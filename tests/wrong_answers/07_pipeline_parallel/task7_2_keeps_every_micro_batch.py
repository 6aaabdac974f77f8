"""Looks up what F(i) kept at B(i) but never lets go of it: every micro-batch's activations stay
alive until step returns, and 1F1B needs GPipe's memory."""

TASK = "task7_2"
EXPECT = r"is still alive, though their backwards have run. Free what was kept for i"


class StageRunner:
    def step(self, actions, inputs=None, targets=None) -> list[float]:
        m = sum(kind == "F" for kind, _ in actions)
        kept, sends, losses = {}, [], {}
        held: dist.P2POp | None = None  # the last action's send, not posted yet
        self.timeline = []
        for kind, i in actions:
            source = (self.stage - 1 if kind == "F" and not self.first
                      else self.stage + 1 if kind == "B" and not self.last else None)
            if held is not None and held.peer != source:  # nothing to fuse it with
                sends.append(dist.isend(held.tensor, dst=held.peer))
                held = None
            if kind == "F":
                if self.first:
                    x = inputs[i]
                else:
                    x = self._receive(source, f"input of micro-batch {i} (F{i})", held)
                    x.requires_grad_(True)
                held = None
                start = time.perf_counter()
                out = self.module(x)
                if self.last:
                    out = self.loss_fn(out, targets[i]) / m
                    losses[i] = out.item() * m
                self.timeline.append(("F", i, start, time.perf_counter()))
                if not self.last:
                    held = dist.P2POp(dist.isend, out.detach(), self.stage + 1)
                kept[i] = (x, out)
            else:
                x, out = kept[i]  # kept for the whole step
                grad = None if self.last else self._receive(
                    source, f"gradient of micro-batch {i} (B{i})", held)
                held = None
                start = time.perf_counter()
                out.backward(grad)
                self.timeline.append(("B", i, start, time.perf_counter()))
                if not self.first:
                    held = dist.P2POp(dist.isend, x.grad, self.stage - 1)
        if held is not None:
            sends.append(dist.isend(held.tensor, dst=held.peer))
        for work in sends:
            work.wait()
        return [losses[i] for i in sorted(losses)]
