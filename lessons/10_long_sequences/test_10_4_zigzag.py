"""Lesson 10, task10_4: zigzag_split and zigzag_merge, the split that balances causal attention
across ranks and its inverse; swept against the rule and against torch's own load balancer.

    pytest lessons/10_long_sequences -m task10_4
"""

from __future__ import annotations

import pytest
import torch

from harness.sweep import st, sweep
from lesson10.common import split_positions, visible_pairs

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task10_4": {
        "2W equal chunks; rank r gets chunks r and 2W-1-r, in that order": [
            "test_zigzag_split_gives_rank_r_chunks_r_and_its_mirror",
            "test_zigzag_split_is_torchs_head_tail_split"],
        "the W pieces in rank order": ["test_zigzag_split_gives_rank_r_chunks_r_and_its_mirror"],
        "along dim, any dim": ["test_zigzag_split_gives_rank_r_chunks_r_and_its_mirror",
                               "test_zigzag_merge_undoes_the_split"],
        "a length that does not divide by 2W raises ValueError naming both": [
            "test_zigzag_split_refuses_a_length_that_does_not_divide"],
        "every rank then sees the same number of (query, key) pairs": [
            "test_zigzag_split_gives_rank_r_chunks_r_and_its_mirror"],
        "zigzag_merge: the inverse": ["test_zigzag_merge_undoes_the_split",
                                      "test_zigzag_merge_follows_the_rule_on_any_pieces"],
    },
}


def labelled(shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """A tensor whose every element is its position along ``dim`` (and more, so that other
    dimensions differ too): where each element went is read from its value."""
    length = shape[dim]
    along = torch.arange(length).reshape([length if i == dim % len(shape) else 1
                                          for i in range(len(shape))])
    rest = torch.arange(torch.Size(shape).numel()).reshape(shape) * 1000
    return along + rest


def diagnose(pieces: list[torch.Tensor], world: int, length: int) -> str:
    """Names the split the pieces are, when it is one we know."""
    got = [piece.tolist() for piece in pieces]
    chunks = torch.arange(length).chunk(2 * world)
    if got == [torch.cat([chunks[r], chunks[world + r]]).tolist() for r in range(world)]:
        return (": that is chunks r and W+r (round robin by halves), which leaves rank 0 with "
                "the least work and rank W-1 with the most; give rank r chunk 2W-1-r")
    if got == [torch.cat([chunks[2 * world - 1 - r], chunks[r]]).tolist() for r in range(world)]:
        return ": the two chunks are the wrong way round: chunk r first, then chunk 2W-1-r"
    if got == [piece.tolist() for piece in torch.arange(length).chunk(world)]:
        return ": that is the contiguous split; cut 2W chunks and pair each with its mirror"
    return ""


@pytest.mark.task10_4
@sweep(world=st.integers(1, 6), chunk=st.integers(1, 4), dims=st.integers(1, 3),
       which=st.integers(0, 2), negative=st.booleans())
def test_zigzag_split_gives_rank_r_chunks_r_and_its_mirror(ex, world, chunk, dims, which,
                                                           negative):
    """zigzag_split gives rank r chunks r and 2W - 1 - r of 2W, and every rank the same number of
    visible (query, key) pairs under a causal mask: on 25 generated cases, 1 to 6 ranks, chunks of 1
    to 4, 1 to 3 dimensions, negative dims too."""
    length = 2 * world * chunk
    dim = min(which, dims - 1)
    shape = tuple(length if i == dim else 2 for i in range(dims))
    dim_arg = dim - dims if negative else dim
    x = labelled(shape, dim)
    pieces = ex.zigzag_split(x, world, dim_arg)
    assert isinstance(pieces, (list, tuple)) and len(pieces) == world, (
        f"zigzag_split({length} tokens, {world} ranks) returned "
        f"{type(pieces).__name__} of {len(pieces) if hasattr(pieces, '__len__') else '?'} "
        f"pieces: expected a list of {world}, one per rank")
    expected = split_positions("zigzag", length, world)
    positions = ex.zigzag_split(torch.arange(length), world, 0)
    why = diagnose(positions, world, length)
    for rank, (piece, mine) in enumerate(zip(pieces, expected, strict=True)):
        want = x.index_select(dim, mine)
        assert piece.shape == want.shape, (
            f"rank {rank}'s piece has shape {tuple(piece.shape)}, expected {tuple(want.shape)} "
            f"(2 chunks of {chunk} along dim {dim_arg}){why}")
        assert torch.equal(piece, want), (
            f"rank {rank}'s piece of {length} tokens over {world} ranks (dim {dim_arg}) holds "
            f"the tokens at {positions[rank].tolist()}, expected {mine.tolist()}{why}")
    work = [visible_pairs(p, length) for p in positions]
    assert len(set(work)) == 1, (
        f"under a causal mask the ranks see {work} (query, key) pairs: unbalanced{why}")


@pytest.mark.task10_4
@pytest.mark.parametrize("length, world", [(8, 2), (12, 3), (16, 4), (24, 4), (4, 1)])
def test_zigzag_split_is_torchs_head_tail_split(ex, length, world):
    """zigzag_split gives each rank the positions torch's `_HeadTailLoadBalancer` gives it: 8, 12,
    16, 24 and 4 tokens on 2, 3, 4, 4 and 1 ranks (skipped on a torch without it)."""
    try:  # a private class, which releases have kept in _context_parallel or in _attention
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
            _HeadTailLoadBalancer,
        )
    except ImportError:
        try:
            from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer
        except ImportError:
            pytest.skip("this torch has no _HeadTailLoadBalancer to compare with")
    torchs = _HeadTailLoadBalancer(length, world, "cpu")._generate_indices()[0].long()
    pieces = ex.zigzag_split(torch.arange(length), world, 0)
    why = diagnose(pieces, world, length)
    for rank, (piece, theirs) in enumerate(zip(pieces, torchs.chunk(world), strict=True)):
        assert piece.tolist() == theirs.tolist(), (
            f"rank {rank} of {world} holds {piece.tolist()} of {length} tokens; torch's "
            f"head-tail load balancer gives it {theirs.tolist()}{why}")


@pytest.mark.task10_4
@pytest.mark.parametrize("length, world", [(7, 1), (6, 2), (10, 4), (9, 3)])
def test_zigzag_split_refuses_a_length_that_does_not_divide(ex, length, world):
    """zigzag_split raises a ValueError naming the length and 2W for 7, 6, 10 and 9 tokens on 1, 2,
    4 and 3 ranks."""
    with pytest.raises(ValueError) as raised:
        pieces = ex.zigzag_split(torch.arange(length), world, 0)
        pytest.fail(f"zigzag_split cut {length} tokens into 2 x {world} chunks without an "
                    f"error ({[p.tolist() for p in pieces]}): raise a ValueError; padding is "
                    f"the caller's choice")
    message = str(raised.value)
    assert str(length) in message and str(2 * world) in message, (
        f"the ValueError should name the length ({length}) and the number of chunks "
        f"({2 * world}): {message!r}")


@pytest.mark.task10_4
@sweep(world=st.integers(1, 6), chunk=st.integers(1, 4), dims=st.integers(1, 3),
       which=st.integers(0, 2))
def test_zigzag_merge_undoes_the_split(ex, world, chunk, dims, which):
    """zigzag_merge puts the rule's pieces back into the whole tensor: on 25 generated cases, 1 to 6
    ranks, chunks of 1 to 4, 1 to 3 dimensions."""
    length = 2 * world * chunk
    dim = min(which, dims - 1)
    x = labelled(tuple(length if i == dim else 3 for i in range(dims)), dim)
    pieces = [x.index_select(dim, mine) for mine in split_positions("zigzag", length, world)]
    got = ex.zigzag_merge(pieces, dim)
    assert got.shape == x.shape, (
        f"zigzag_merge of {world} pieces of {2 * chunk} along dim {dim} has shape "
        f"{tuple(got.shape)}, expected {tuple(x.shape)}")
    assert torch.equal(got, x), (
        f"zigzag_merge of {world} pieces ({length} tokens, dim {dim}) gives the positions "
        f"{_positions(got, dim)}, expected "
        f"{list(range(length))}: put each rank's first chunk back in rank order, then the "
        f"second chunks in reverse rank order")


def _positions(x: torch.Tensor, dim: int) -> list[int]:
    return (x.movedim(dim, 0).reshape(x.shape[dim], -1)[:, 0] % 1000).tolist()


@pytest.mark.task10_4
@pytest.mark.parametrize("world", [1, 2, 3])
def test_zigzag_merge_follows_the_rule_on_any_pieces(ex, world):
    """zigzag_merge follows the rule on random pieces that are no split of anything, for 1, 2 and 3
    ranks: piece r's first half is chunk r, its second half chunk 2W - 1 - r."""
    length = 4 * world
    pieces = [torch.randn(2, 4, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    got = ex.zigzag_merge(pieces, 1)
    expected = torch.empty(2, length)
    for piece, mine in zip(pieces, split_positions("zigzag", length, world), strict=True):
        expected[:, mine] = piece
    assert torch.equal(got, expected), (
        f"zigzag_merge of {world} random pieces of 4 along dim 1 is not the sequence the rule "
        f"gives: piece r's first half is chunk r, its second half chunk 2W-1-r")
