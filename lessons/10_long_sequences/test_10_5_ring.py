"""Lesson 10, task10_5: ring_attention, attention over a sequence split across 1 to 4 ranks,
contiguous and zig-zag, causal and not, against attention over the whole sequence; the passes
counted, the largest tensor measured, the skipped blocks checked. On gloo/CPU ranks (and on
CUDA where present).

    pytest lessons/10_long_sequences -m task10_5
"""

from __future__ import annotations

import pytest
import torch

from harness.compare import assert_close
from harness.exercises import load_exercise, raise_if_untouched
from harness.ranks import RankError, get_pool, run_on_ranks
from lesson10.common import (
    LESSON,
    RING_GROUPS,
    TIGHT,
    LargestTensor,
    reference_attention,
    seeded,
    split_positions,
)

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task10_5": {
        "out and lse: attention over the whole sequence for this rank's queries": [
            "test_ring_attention_equals_attention_over_the_whole_sequence"],
        "any split: contiguous or zig-zag": [
            "test_ring_attention_equals_attention_over_the_whole_sequence"],
        "the gradient reaches q through autograd": [
            "test_ring_attention_equals_attention_over_the_whole_sequence"],
        "and this rank's own k and v": [
            "test_ring_attention_equals_attention_over_the_whole_sequence"],
        "W - 1 ring_pass steps": ["test_ring_attention_passes_each_block_once_around",
                                  "test_ring_attention_stays_within_its_group"],
        "every rank makes the same number of passes (else the ring hangs)": [
            "test_ring_attention_equals_attention_over_the_whole_sequence"],
        "never more than one block of scores at a time": [
            "test_ring_attention_never_holds_more_than_one_block"],
        "no tensor above one block's keys and values, or one block of scores": [
            "test_ring_attention_never_holds_more_than_one_block"],
        "causal: a block no query may see is skipped, no scores": [
            "test_ring_attention_skips_the_blocks_no_query_sees"],
        "causal defaults to True": ["test_ring_attention_is_causal_by_default"],
        "within group only": ["test_ring_attention_stays_within_its_group"],
    },
}

BATCH, HEADS, TOKENS, HEAD_DIM = 2, 2, 6, 4  # each rank's tokens; TOKENS > HEAD_DIM


def ring_run(ctx, layout: str, causal: bool, groups=None):
    """This rank's ring_attention over a sequence whose q, k, v every rank can rebuild from
    seeds, with the ring passes and the attend_block calls counted and the largest tensor any
    operation built recorded."""
    ex = load_exercise(LESSON)
    group, members = None, list(range(ctx.world_size))
    for ranks in groups or ():
        made = torch.distributed.new_group(ranks)
        if ctx.rank in ranks:
            group, members = made, ranks
    world, place = len(members), members.index(ctx.rank)
    length = TOKENS * world
    mine = split_positions(layout, length, world)[place]
    q, k, v = (seeded(i, BATCH, HEADS, length, HEAD_DIM).index_select(2, mine).to(ctx.device)
               for i in range(3))
    # Keys and values as a model makes them, (B, T, H, D) transposed: not contiguous.
    k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    for t in (q, k, v):
        t.requires_grad_(True)
    counted = {"ring_pass": 0, "attend_block": 0}
    real = {name: getattr(ex, name) for name in counted}
    stuck: list[str] = []

    def counting(name):
        def call(*args, **kwargs):
            counted[name] += 1
            try:
                return real[name](*args, **kwargs)
            except Exception as error:
                if name == "ring_pass":  # its neighbour never joined this pass
                    stuck.append(str(error).rsplit("] ", 1)[-1][:200])  # gloo's words
                raise
        return call

    for name in counted:
        setattr(ex, name, counting(name))
    try:
        with LargestTensor() as seen:
            if causal is None:  # the default
                out, lse = ex.ring_attention(q, k, v, mine.to(ctx.device), group)
            else:
                out, lse = ex.ring_attention(q, k, v, mine.to(ctx.device), group, causal)
    except Exception:
        if not stuck:
            raise
        # The counts say which rank left the ring early: the parent compares them
        return {"stuck": stuck[0], "members": members, **counted}
    finally:
        for name, function in real.items():
            setattr(ex, name, function)
    c = seeded(10, BATCH, HEADS, length, HEAD_DIM).index_select(2, mine).to(ctx.device)
    d = seeded(11, BATCH, HEADS, length).index_select(2, mine).to(ctx.device)
    ((out * c).sum() + (lse * d).sum()).backward()
    return {"out": out.detach(), "lse": lse.detach(), "grad": q.grad, "positions": mine,
            "grad_k": k.grad, "grad_v": v.grad,
            "members": members, "largest": seen.largest, "product": seen.largest_product,
            **counted}


HUNG: list[str] = []  # the first ring that hung: every later ring would too, and wait as long


def rings(layout: str, causal, groups=None, world_size: int = 2, **where) -> list[dict]:
    """ring_run on the ranks. A ring that hangs (some rank's ring_pass waits for a neighbour
    that never joins) fails with the passes each rank made, once: later rings fail at once."""
    if HUNG:
        raise AssertionError(f"not run: an earlier ring hung, and this one would wait as long "
                             f"({HUNG[0]})")
    try:
        results = run_on_ranks(ring_run, layout, causal, groups, world_size=world_size,
                               **where)
    except RankError as error:  # a hang outside ring_pass: stop the next rings waiting too
        if "imed out" in str(error) or "did not finish" in str(error):
            HUNG.append(str(error).splitlines()[0][:300])
        raise
    stuck = [rank for rank, got in enumerate(results) if "stuck" in got]
    if stuck:
        get_pool(world_size, where.get("backend", "gloo"), where.get("device", "cpu")).close()
        passes = ", ".join(f"rank {rank}: {got['ring_pass']}" for rank, got in
                           enumerate(results))
        world = len(results[stuck[0]]["members"])
        HUNG.append(f"ring_pass calls per rank: {passes}; every rank must make the same "
                    f"number of passes, W - 1")
        raise AssertionError(
            f"ring_attention hung on {world} ranks: ring_pass on rank(s) {stuck} waited for a "
            f"neighbour that never joined ({results[stuck[0]]['stuck']}). The ranks called "
            f"ring_pass this many times ({passes}; a pass still waiting counts). Each pass is "
            f"a send to the next rank and a receive from the previous one, which both "
            f"neighbours must join: every rank of the group must make the same number of "
            f"passes, W - 1 = {world - 1}, whatever its place or which blocks it skips")
    return results


def whole(world: int, causal: bool):
    """out, lse and the gradient of q over the whole sequence, in one process."""
    length = TOKENS * world
    q, k, v = (seeded(i, BATCH, HEADS, length, HEAD_DIM) for i in range(3))
    q.requires_grad_(True)
    positions = torch.arange(length)
    out, lse = reference_attention(q, k, v, positions, positions, causal)
    c, d = seeded(10, BATCH, HEADS, length, HEAD_DIM), seeded(11, BATCH, HEADS, length)
    ((out * c).sum() + (lse * d).sum()).backward()
    return out.detach(), lse.detach(), q.grad


def own_keys_gradients(world: int, causal: bool, mine: torch.Tensor):
    """What autograd gives a rank's own k and v through ring_attention: the gradient of its own
    queries' loss with respect to the keys and values at its own positions (the other ranks'
    blocks arrive as new tensors, outside the graph)."""
    length = TOKENS * world
    q, k, v = (seeded(i, BATCH, HEADS, length, HEAD_DIM) for i in range(3))
    k.requires_grad_(True)
    v.requires_grad_(True)
    positions = torch.arange(length)
    out, lse = reference_attention(q.index_select(2, mine), k, v, mine, positions, causal)
    c = seeded(10, BATCH, HEADS, length, HEAD_DIM).index_select(2, mine)
    d = seeded(11, BATCH, HEADS, length).index_select(2, mine)
    ((out * c).sum() + (lse * d).sum()).backward()
    return k.grad.index_select(2, mine), v.grad.index_select(2, mine)


def needed_blocks(positions: torch.Tensor, world: int, layout: str, causal: bool) -> int:
    """How many blocks (its own included) hold a key some query at ``positions`` may see."""
    if not causal:
        return world
    return sum(int(block.min() <= positions.max())
               for block in split_positions(layout, TOKENS * world, world))


@pytest.mark.task10_5
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("group", RING_GROUPS)
def test_ring_attention_equals_attention_over_the_whole_sequence(ex, group, layout, causal):
    """ring_attention equals attention over the whole sequence in one process: out, lse, the
    gradient of q and of the rank's own k and v, on 1 to 4 gloo ranks, contiguous and zig-zag,
    causal and not, to 1e-9 in float64.

    A rank's own k and v get its own queries' share of the gradient: the other blocks arrive outside
    autograd's graph."""
    world, backend, device = group
    raise_if_untouched(ex.ring_attention)
    results = rings(layout, causal, world_size=world, backend=backend, device=device)
    out, lse, grad = whole(world, causal)
    for rank, got in enumerate(results):
        mine = got["positions"]
        case = f"({layout} split, {'causal' if causal else 'no mask'}, {world} ranks)"
        for name, theirs in (("out", out), ("lse", lse)):
            why = ""
            if name == "lse" and torch.allclose(got["lse"], lse.index_select(2, mine)
                                                + torch.log(torch.tensor(2.0, dtype=lse.dtype))):
                why = (": exactly log 2 too much, as if every block had been merged in twice: "
                       "count the passes (W - 1, W the group's size)")
            try:
                assert_close(got[name], theirs.index_select(2, mine), f"ring_attention's {name} "
                             f"{case} at positions {mine.tolist()}", rank, **TIGHT)
            except AssertionError as error:
                raise AssertionError(f"{error}{why}") from None
        assert got["grad"] is not None, (f"rank {rank}: no gradient reached q through "
                                         f"ring_attention {case}")
        assert_close(got["grad"], grad.index_select(2, mine), f"the gradient of q through "
                     f"ring_attention {case}", rank, **TIGHT)
        for name, want in zip(("k", "v"), own_keys_gradients(world, causal, mine), strict=True):
            assert got[f"grad_{name}"] is not None, (
                f"rank {rank}: no gradient reached this rank's own {name} through "
                f"ring_attention {case}: attend to its own block with the {name} it was given")
            assert_close(got[f"grad_{name}"], want, f"the gradient of this rank's own {name} "
                         f"through ring_attention {case} (its own queries' use of it)", rank,
                         **TIGHT)


@pytest.mark.task10_5
@pytest.mark.parametrize("world", [1, 2, 4])
def test_ring_attention_passes_each_block_once_around(ex, world):
    """ring_attention calls ring_pass W - 1 times on every rank, on 1, 2 and 4 gloo ranks."""
    raise_if_untouched(ex.ring_attention)
    for rank, got in enumerate(rings("zigzag", False, world_size=world)):
        back = "; a W-th sends each block back where it started" if got["ring_pass"] else ""
        assert got["ring_pass"] == world - 1, (
            f"rank {rank} of {world}: ring_attention called ring_pass {got['ring_pass']} "
            f"time(s): W - 1 = {world - 1} passes bring it every other rank's block (it starts "
            f"with its own){back if got['ring_pass'] == world else ''}")


@pytest.mark.task10_5
@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_never_holds_more_than_one_block(ex, world):
    """ring_attention builds no matrix product larger than one block of scores, and no tensor larger
    than that or than one block's keys and values together, on 2 and 4 gloo ranks (a dispatch mode
    records every operation's output).

    k and v stacked for one ring_pass are fine. At W = 4 the whole sequence's keys alone are twice
    that."""
    raise_if_untouched(ex.ring_attention)
    block = BATCH * HEADS * TOKENS * TOKENS  # one block of scores: this rank's queries x keys
    keys_and_values = 2 * BATCH * HEADS * TOKENS * HEAD_DIM  # one block's k and v
    for rank, got in enumerate(rings("contiguous", False, world_size=world)):
        size, shape = got["product"]
        assert size <= block, (
            f"rank {rank} of {world}: a matrix product inside ring_attention built a tensor of "
            f"{size} elements, {list(shape)}; one block of scores is {block} ({BATCH} x "
            f"{HEADS} x {TOKENS} queries x {TOKENS} keys). Attend to one block of keys at a "
            f"time: scores over the whole sequence's keys are what ring attention avoids")
        assert got["largest"] <= max(block, keys_and_values), (
            f"rank {rank} of {world}: an operation inside ring_attention built a tensor of "
            f"{got['largest']} elements, more than one block of scores ({block}) and more than "
            f"one block's keys and values together ({keys_and_values}: {BATCH} x {HEADS} x "
            f"{TOKENS} tokens x {HEAD_DIM} x 2). Hold one block at a time: the whole "
            f"sequence's keys or values are what ring attention avoids")


@pytest.mark.task10_5
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_attention_skips_the_blocks_no_query_sees(ex, world, layout):
    """Under a causal mask, ring_attention calls attend_block exactly for the blocks that hold a key
    some query of the rank may see, on 2, 3 and 4 gloo ranks, contiguous and zig-zag."""
    raise_if_untouched(ex.ring_attention)
    for rank, got in enumerate(rings(layout, True, world_size=world)):
        needed = needed_blocks(got["positions"], world, layout, True)
        assert got["attend_block"] == needed, (
            f"rank {rank} of {world} ({layout} split, causal): attend_block ran "
            f"{got['attend_block']} time(s); {needed} of the {world} blocks hold a key its "
            f"queries may see. "
            + ("Skip a block whose keys all come after every query of this rank (compare the "
               "positions): its scores would all be masked"
               if got["attend_block"] > needed else
               "A block was skipped that some query sees: compare its smallest key position "
               "with this rank's largest query position"))


@pytest.mark.task10_5
def test_ring_attention_is_causal_by_default(ex):
    """ring_attention with causal left to its default is causal: its out on 2 gloo ranks,
    contiguous, against causal attention over the whole sequence."""
    raise_if_untouched(ex.ring_attention)
    out, lse, _ = whole(2, True)
    for rank, got in enumerate(rings("contiguous", None, world_size=2)):
        assert_close(got["out"], out.index_select(2, got["positions"]),
                     "ring_attention's out with causal left to its default (True)", rank,
                     **TIGHT)


@pytest.mark.task10_5
def test_ring_attention_stays_within_its_group(ex):
    """ring_attention with `group=` is a ring of the group: on 4 gloo ranks in groups [0, 2] and [1,
    3], zig-zag and causal, one pass each, and the out, lse and q's gradient of attention over the
    group's own sequence."""
    raise_if_untouched(ex.ring_attention)
    results = rings("zigzag", True, [[0, 2], [1, 3]], world_size=4)
    out, lse, grad = whole(2, True)
    for rank, got in enumerate(results):
        assert got["ring_pass"] == 1, (
            f"rank {rank}: ring_attention called ring_pass {got['ring_pass']} time(s) in a group "
            f"of 2 ranks: W - 1 = 1, with W the group's size (dist.get_world_size(group))")
        for name, theirs in (("out", out), ("lse", lse), ("grad", grad)):
            assert_close(got[name], theirs.index_select(2, got["positions"]),
                         f"ring_attention's {name} with group={got['members']}: a ring of the "
                         f"group's 2 ranks, passing to the next rank of the group", rank, **TIGHT)
