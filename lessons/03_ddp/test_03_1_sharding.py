"""Grades task3_1, shard_indices: the indices DistributedSampler gives each rank, for every
dataset length, number of replicas, seed and epoch, with and without drop_last.

    pytest lessons/03_ddp -m task3_1
"""

from __future__ import annotations

import pytest
from torch.utils.data import DistributedSampler

from harness.sweep import st, sweep
from lesson03.common import sampler_indices

# This task's contract, clause by clause, and the tests that fail when only that clause
# is broken (tests/test_course.py checks the names).
CLAUSES = {
    "task3_1": {
        # The sweep beyond the grid skips while the grid fails (one mistake, one failure),
        # so it holds no clause alone: it finds what the grid's sizes miss.
        "the same permutation on every rank: a torch.Generator seeded with seed + epoch": [
            "test_shard_indices_equal_distributed_sampler"],
        "the tail padded by repeating indices from the start": [
            "test_shard_indices_equal_distributed_sampler"],
        "or cut, with drop_last": ["test_shard_indices_equal_distributed_sampler"],
        "then every num_replicas-th index starting at rank": [
            "test_shard_indices_equal_distributed_sampler"],
        "DistributedSampler's defaults: shuffle, seed 0, epoch 0, no drop_last": [
            "test_shard_indices_defaults_are_distributed_samplers"],
    },
}

SWEEP_LENGTHS = (1, 2, 3, 5, 7, 10, 16, 33)
SWEEP_WORLDS = (1, 2, 3, 4)


def grid_mismatch(ex) -> str | None:
    """The first call on the grid whose answer differs from DistributedSampler's, with the likely
    mistake; None when every call agrees. The other tests look here first, so that one mistake
    is one failure, this one, with its diagnosis."""
    for shuffle in (True, False):
        for drop_last in (False, True):
            for length in SWEEP_LENGTHS:
                for world in SWEEP_WORLDS:
                    for seed, epoch in ((0, 0), (0, 1), (7, 3)):
                        for rank in range(world):
                            call = (f"shard_indices(dataset_len={length}, num_replicas={world}, "
                                    f"rank={rank}, shuffle={shuffle}, seed={seed}, "
                                    f"epoch={epoch}, drop_last={drop_last})")
                            got = ex.shard_indices(length, world, rank, shuffle=shuffle,
                                                   seed=seed, epoch=epoch, drop_last=drop_last)
                            want = sampler_indices(length, world, rank, shuffle, seed, epoch,
                                                   drop_last)
                            if not isinstance(got, list):
                                return f"{call} returned {type(got).__name__}, not list"
                            if [int(i) for i in got] != want:
                                why = shard_diagnosis(ex, length, world, shuffle, seed, epoch,
                                                      drop_last)
                                return (f"{call} = {got}, but DistributedSampler yields {want}"
                                        + (f". {why}" if why else ""))
    return None


def skip_if_the_grid_fails(ex) -> None:
    if grid_mismatch(ex) is not None:
        pytest.skip("shard_indices fails test_shard_indices_equal_distributed_sampler: its "
                    "message says what to fix first")


@pytest.mark.task3_1
def test_shard_indices_equal_distributed_sampler(ex):
    """shard_indices returns DistributedSampler's indices on every rank of a grid: lengths 1, 2, 3,
    5, 7, 10, 16 and 33 on 1 to 4 replicas, (seed, epoch) (0, 0), (0, 1) and (7, 3), shuffle and
    drop_last on and off, as a list."""
    mismatch = grid_mismatch(ex)
    if mismatch is not None:
        raise AssertionError(mismatch)


@pytest.mark.task3_1
@sweep(length=st.integers(0, 500), world=st.integers(1, 64), shuffle=st.booleans(),
       drop_last=st.booleans(), seed=st.integers(0, 2**31 - 1), epoch=st.integers(0, 1000),
       data=st.data(), max_examples=60)
def test_shard_indices_equal_distributed_sampler_for_any_split(ex, length, world, shuffle,
                                                             drop_last, seed, epoch, data):
    """Beyond the grid, shard_indices returns DistributedSampler's indices in 60 drawn cases:
    lengths 0 to 500, 1 to 64 replicas, any rank, any seed, epochs 0 to 1000, shuffle and drop_last
    on or off.

    It skips while the grid fails, so that one mistake is one failure."""
    skip_if_the_grid_fails(ex)
    rank = data.draw(st.integers(0, world - 1), label="rank")
    got = ex.shard_indices(length, world, rank, shuffle=shuffle, seed=seed, epoch=epoch,
                           drop_last=drop_last)
    want = sampler_indices(length, world, rank, shuffle, seed, epoch, drop_last)
    if [int(i) for i in got] != want:
        why = shard_diagnosis(ex, length, world, shuffle, seed, epoch, drop_last)
        raise AssertionError(
            f"shard_indices(dataset_len={length}, num_replicas={world}, rank={rank}, "
            f"shuffle={shuffle}, seed={seed}, epoch={epoch}, drop_last={drop_last}) = "
            f"{got[:12]}{' ...' if len(got) > 12 else ''}, but DistributedSampler yields "
            f"{want[:12]}{' ...' if len(want) > 12 else ''}" + (f". {why}" if why else ""))


@pytest.mark.task3_1
def test_shard_indices_defaults_are_distributed_samplers(ex):
    """Called without the keywords, shard_indices is DistributedSampler(dataset, world, rank) with
    its defaults, on every rank of 10 samples on 3 replicas and 5 on 4."""
    skip_if_the_grid_fails(ex)
    for length, world in ((10, 3), (5, 4)):
        for rank in range(world):
            got = ex.shard_indices(length, world, rank)
            want = list(DistributedSampler(range(length), num_replicas=world, rank=rank))
            assert [int(i) for i in got] == want, (
                f"shard_indices({length}, {world}, {rank}) = {got}, but DistributedSampler("
                f"dataset, {world}, {rank}) yields {want}: keep its defaults, shuffle=True, "
                f"seed=0, epoch=0, drop_last=False")


def interleaved(shards: list[list[int]]) -> list[int]:
    """The one order the shards were cut from: shard r holds positions r, r + W, r + 2W, ..."""
    return [shards[i % len(shards)][i // len(shards)] for i in range(sum(map(len, shards)))]


def shard_diagnosis(ex, length, world, shuffle, seed, epoch, drop_last) -> str:
    """One line naming the likely mistake, from every rank's answer for this call; or ""."""
    def answers(at_epoch):
        return [[int(i) for i in ex.shard_indices(length, world, rank, shuffle=shuffle,
                                                   seed=seed, epoch=at_epoch,
                                                   drop_last=drop_last)]
                for rank in range(world)]

    def expected(at_epoch):
        return [sampler_indices(length, world, rank, shuffle, seed, at_epoch, drop_last)
                for rank in range(world)]

    try:
        got, want = answers(epoch), expected(epoch)
        if shuffle and epoch != 0 and answers(0) == expected(0):
            return (f"epoch 0 matches but epoch {epoch} does not: is the order seeded with "
                    f"seed + epoch?")
    except Exception:  # noqa: BLE001 - no diagnosis; the comparison above says what differs
        return ""
    lengths, per_rank = [len(s) for s in got], len(want[0])
    if lengths != [per_rank] * world:
        if drop_last:
            return (f"the ranks got {lengths} indices: with drop_last every rank gets "
                    f"N // W = {per_rank}, the tail that does not divide is cut")
        if sum(lengths) == length:
            return (f"the ranks got {lengths} indices, {length} in all: no padding. Every rank "
                    f"must get ceil(N / W) = {per_rank}: pad the order by repeating indices "
                    f"from its start")
        return f"the ranks got {lengths} indices; every rank must get {per_rank}"
    full_got, full_want = interleaved(got), interleaved(want)
    if [i for shard in got for i in shard] == full_want:
        return (f"each rank got a contiguous block of the order; DistributedSampler gives rank "
                f"r every W-th index, starting at r: order[r::W], here order[r::{world}]")
    kept = min(length, len(full_want))
    if full_got[:kept] == full_want[:kept]:
        return (f"the first {kept} indices of the order match but the padding differs: "
                f"DistributedSampler pads with the order's first indices, repeated from the "
                f"start")
    if not shuffle:
        return "with shuffle=False the order is 0, 1, 2, ... before padding"
    if sorted(set(full_got)) == list(range(length)):
        return ("the permutation differs from DistributedSampler's: torch.randperm(N, "
                "generator=g) with g = torch.Generator() seeded with seed + epoch")
    return ""
