"""The running example's data: the characters of a small text, cut into (input, target) windows.

``text.txt`` beside this file holds about 36 KB of Shakespeare: 33 of the sonnets (1609) and
well-known speeches from the plays (First Folio, 1623), in modernised spelling, ASCII only.
Shakespeare's works are in the public domain; this copy was typed for the course. It ships with
the course, so nothing is ever downloaded (training clusters are often offline).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset, Subset

TEXT_PATH = Path(__file__).with_name("text.txt")


def load_text(path: str | Path = TEXT_PATH) -> str:
    return Path(path).read_text(encoding="utf-8")


class CharDataset(Dataset):
    """Windows of ``block_size + 1`` characters: ``x`` is the first ``block_size`` ids, ``y`` the
    same window shifted by one, so ``y[t]`` is the character that follows ``x[:t + 1]``.

    Map-style and deterministic: sample ``i`` is always the window starting at ``i * stride``,
    which is what lets ``DistributedSampler`` hand each rank its own indices. ``stride`` defaults
    to ``block_size``: neighbouring windows share one character (the last target of one is the
    first input of the next), so each character is a target exactly once per epoch. A smaller
    stride gives more, overlapping windows (``stride=1``: one per character).
    """

    def __init__(self, block_size: int, text: str | None = None, stride: int | None = None):
        self.text = load_text() if text is None else text
        self.block_size = block_size
        self.stride = stride or block_size
        self.chars = sorted(set(self.text))  # sorted: the same text always gives the same ids
        self.vocab_size = len(self.chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor(self.encode(self.text), dtype=torch.long)
        if len(self.data) < block_size + 1:
            raise ValueError(f"text of {len(self.data)} chars is too short for block_size "
                             f"{block_size}")

    def encode(self, s: str) -> list[int]:
        return [self.stoi[c] for c in s]

    def decode(self, ids) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.chars[i] for i in ids)

    def __len__(self) -> int:
        return (len(self.data) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = range(len(self))[i] * self.stride  # range() checks bounds, allows negative i
        window = self.data[start:start + self.block_size + 1]
        return window[:-1].clone(), window[1:].clone()  # clones: the caller may edit in place


def train_val_split(dataset: Dataset, val_fraction: float = 0.1) -> tuple[Subset, Subset]:
    """The first windows for training, the last ``val_fraction`` for validation.

    Contiguous, not shuffled: overlapping neighbours would otherwise leak validation text into
    training. Both parts keep the dataset's vocabulary (``part.dataset.vocab_size``).
    """
    n_val = max(1, round(len(dataset) * val_fraction))
    n_train = len(dataset) - n_val
    return Subset(dataset, range(n_train)), Subset(dataset, range(n_train, len(dataset)))
