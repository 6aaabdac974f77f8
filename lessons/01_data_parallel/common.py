"""What the test files of lesson 01 share: TinyNet, the small model that records every forward
it runs (and on which copy), the batches it trains on, the chunk sizes DataParallel's scatter
makes, and the arguments both train.py runs are given."""

from __future__ import annotations

import torch
from torch import nn

from harness.launch import QUICK_SAMPLE

LESSON = "01_data_parallel"

# train.py is lesson 00's train.py plus nn.DataParallel. Both are started together, once, with
# the same arguments, none of them the default: a script that ignored one (the seed, say) would
# train a different model from lesson 00's.
TRAIN_ARGS = ("--epochs", "1", "--seed", "3", "--batch-size", "32", "--train-windows", "320",
              *QUICK_SAMPLE)
BASE_LESSON = "00_single_gpu"


class TinyNet(nn.Module):
    """A small MLP that records the batch size and device of every forward it runs.

    The record is a list on the class, so every copy of the model writes to it, however the
    copy was made (``copy.deepcopy``, or DataParallel's replicas running in threads).
    ``runners`` records, in the same order, which instance ran: the model itself or a copy.
    """

    calls: list[tuple[int, torch.device]] = []
    runners: list[nn.Module] = []

    def __init__(self, n_in: int = 5, n_hidden: int = 16, n_out: int = 3, seed: int = 0):
        super().__init__()
        self.hidden = nn.Linear(n_in, n_hidden)
        self.out = nn.Linear(n_hidden, n_out)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        TinyNet.calls.append((x.shape[0], x.device))
        TinyNet.runners.append(self)
        return self.out(torch.tanh(self.hidden(x)))


def clear_call_record() -> None:
    TinyNet.calls.clear()
    TinyNet.runners.clear()


def make_batch(batch_size: int, classes: bool = False, seed: int = 1):
    """Inputs (B, 5) and targets: (B, 3) for regression, or (B,) class ids for classification."""
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch_size, 5, generator=g)
    if classes:
        return inputs, torch.randint(0, 3, (batch_size,), generator=g)
    return inputs, torch.randn(batch_size, 3, generator=g)


def chunk_sizes(batch_size: int, num_replicas: int) -> list[int]:
    """The truth: DataParallel's scatter cuts the batch with Tensor.chunk."""
    return [len(c) for c in torch.empty(batch_size).chunk(num_replicas)]


def seen_batch_sizes() -> list[int]:
    return [size for size, _ in TinyNet.calls]
