"""Lesson 01, task1_1 and task1_2: the scatter, as DataParallel does it: how many samples each
chunk holds (scatter_sizes), and the chunks themselves (scatter), checked against Tensor.chunk.

    pytest lessons/01_data_parallel -m task1_1
    pytest lessons/01_data_parallel -m task1_2
"""

from __future__ import annotations

import pytest
import torch

from harness.compare import assert_close
from lesson01.common import chunk_sizes

# Each task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task1_1": {
        "every chunk holds ceil(batch_size / num_replicas) samples": [
            "test_scatter_sizes_examples", "test_scatter_sizes_match_tensor_chunk_everywhere"],
        "except the last one, which holds what is left": [
            "test_scatter_sizes_examples", "test_scatter_sizes_match_tensor_chunk_everywhere"],
        "there can be fewer chunks than replicas": [
            "test_scatter_sizes_examples", "test_scatter_sizes_match_tensor_chunk_everywhere"],
        "the chunk sizes in order, as ints": ["test_scatter_sizes_examples"],
    },
    "task1_2": {
        "chunk i holds the next scatter_sizes(len(batch), num_replicas)[i] samples": [
            "test_scatter_cuts_consecutive_chunks"],
        "in their original order": ["test_scatter_cuts_consecutive_chunks"],
    },
}


# --------------------------------------------------------------------------------------------
# task1_1: scatter_sizes


@pytest.mark.task1_1
@pytest.mark.parametrize(
    "batch_size, num_replicas, expected",
    [(12, 3, [4, 4, 4]), (10, 3, [4, 4, 2]), (5, 4, [2, 2, 1]), (2, 3, [1, 1]), (7, 1, [7])],
    ids=["12 on 3", "10 on 3", "5 on 4", "2 on 3", "7 on 1"],
)
def test_scatter_sizes_examples(ex, batch_size, num_replicas, expected):
    """scatter_sizes returns DataParallel's chunk sizes as a list of ints: [4, 4, 4] for 12 samples
    on 3 replicas, [4, 4, 2] for 10 on 3, [2, 2, 1] for 5 on 4, [1, 1] for 2 on 3 and [7] for 7 on
    1."""
    got = ex.scatter_sizes(batch_size, num_replicas)
    per_chunk = -(-batch_size // num_replicas)
    assert isinstance(got, (list, tuple)) and all(isinstance(s, int) for s in got), (
        f"scatter_sizes({batch_size}, {num_replicas}) returned {got!r}; expected a list of ints"
    )
    assert list(got) == expected, (
        f"scatter_sizes({batch_size}, {num_replicas}) returned {list(got)}; DataParallel sends "
        f"{expected}: every chunk gets ceil({batch_size}/{num_replicas}) = {per_chunk} samples, "
        f"the last one what is left, and devices left over get no chunk at all"
    )


@pytest.mark.task1_1
def test_scatter_sizes_match_tensor_chunk_everywhere(ex):
    """scatter_sizes agrees with Tensor.chunk, the rule of DataParallel's scatter, for every batch
    size from 1 to 40 on 1 to 9 replicas (360 cases)."""
    wrong = []
    for batch_size in range(1, 41):
        for num_replicas in range(1, 10):
            got = list(ex.scatter_sizes(batch_size, num_replicas))
            expected = chunk_sizes(batch_size, num_replicas)
            if got != expected:
                wrong.append(f"({batch_size}, {num_replicas}): got {got}, expected {expected}")
    assert not wrong, (
        f"scatter_sizes differs from Tensor.chunk (what DataParallel's scatter uses) in "
        f"{len(wrong)} of 360 cases, for example " + "; ".join(wrong[:3])
    )


# --------------------------------------------------------------------------------------------
# task1_2: scatter


@pytest.mark.task1_2
@pytest.mark.parametrize("batch_size, num_replicas", [(12, 3), (10, 3), (5, 4), (2, 3), (9, 1)],
                         ids=["12 on 3", "10 on 3", "5 on 4", "2 on 3", "9 on 1"])
def test_scatter_cuts_consecutive_chunks(ex, batch_size, num_replicas):
    """scatter makes as many chunks as Tensor.chunk, chunk i holding the next samples in their
    original order, compared value by value for 12 samples on 3 replicas, 10 on 3, 5 on 4, 2 on 3
    and 9 on 1."""
    batch = torch.arange(batch_size * 2, dtype=torch.float32).reshape(batch_size, 2)
    chunks = ex.scatter(batch, num_replicas)
    expected = chunk_sizes(batch_size, num_replicas)
    got_sizes = [tuple(c.shape) for c in chunks]
    assert len(chunks) == len(expected), (
        f"scatter(a batch of {batch_size}, {num_replicas}) gave {len(chunks)} chunks of shapes "
        f"{got_sizes}; DataParallel makes {len(expected)} chunks of sizes {expected}"
    )
    start = 0
    for i, (chunk, size) in enumerate(zip(chunks, expected, strict=True)):
        assert_close(chunk, batch[start:start + size],
                     f"chunk {i} of a batch of {batch_size} on {num_replicas} replicas "
                     f"(it should hold samples {start}..{start + size - 1}, in order)")
        start += size
