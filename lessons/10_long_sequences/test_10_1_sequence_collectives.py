"""Lesson 10, task10_1: sequence parallel's two collectives (AllGatherSequence,
ReduceScatterSequence). One gathers the tokens in forward and reduce-scatters their gradient in
backward, the other the reverse; each communicates once in each direction, within its group.
On gloo/CPU ranks, 1 to 4 of them (and on CUDA where present).

    pytest lessons/10_long_sequences -m task10_1
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness.collectives import CollectiveLog
from harness.compare import assert_close
from harness.exercises import load_exercise, raise_if_untouched
from harness.ranks import run_on_ranks
from lesson10.common import GROUPS, LESSON, TIGHT, seeded

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task10_1": {
        "AllGatherSequence forward: every rank's x along dim, in rank order":
            ["test_all_gather_sequence_gathers_forward_and_reduce_scatters_backward"],
        "AllGatherSequence forward: one all-gather":
            ["test_all_gather_sequence_gathers_forward_and_reduce_scatters_backward"],
        "AllGatherSequence backward: this rank's piece of the sum over ranks, a reduce-scatter":
            ["test_all_gather_sequence_gathers_forward_and_reduce_scatters_backward"],
        "ReduceScatterSequence forward: piece r of the sum over ranks, a reduce-scatter":
            ["test_reduce_scatter_sequence_sums_forward_and_gathers_backward"],
        "ReduceScatterSequence forward: x unchanged":
            ["test_reduce_scatter_sequence_sums_forward_and_gathers_backward"],
        "ReduceScatterSequence backward: every rank's gradient along dim, an all-gather":
            ["test_reduce_scatter_sequence_sums_forward_and_gathers_backward"],
        "ReduceScatterSequence: a size that does not divide raises ValueError naming both":
            ["test_reduce_scatter_sequence_refuses_a_size_that_does_not_divide"],
        "dim defaults to 1": [
            "test_all_gather_sequence_gathers_forward_and_reduce_scatters_backward",
            "test_reduce_scatter_sequence_sums_forward_and_gathers_backward"],
        "along dim, any dim": [
            "test_all_gather_sequence_gathers_forward_and_reduce_scatters_backward",
            "test_reduce_scatter_sequence_sums_forward_and_gathers_backward"],
        "within group only": ["test_sequence_collectives_stay_within_their_group"],
        "backward returns (gradient, None, None)": [
            "test_all_gather_sequence_gathers_forward_and_reduce_scatters_backward",
            "test_reduce_scatter_sequence_sums_forward_and_gathers_backward"],
    },
}

LOCAL = (2, 3, 4)  # a rank's tokens: LOCAL[dim] along the split dimension


def whole_shape(dim: int, world: int) -> tuple[int, ...]:
    shape = list(LOCAL)
    shape[dim] *= world
    return tuple(shape)


def sp_run(ctx, which: str, dim: int, groups=None):
    """``which`` ("gather" or "scatter") forward and backward on this rank, its collectives
    counted. ``groups``: the subgroups to build (every rank builds all), this rank's is used.

    gather: x is this rank's tokens; the loss is (y * c).sum() with c this rank's own weights
    over the whole sequence. scatter: x is this rank's partial sum over the whole sequence; the
    loss weighs this rank's piece of the output with c."""
    ex = load_exercise(LESSON)
    group, members = None, list(range(ctx.world_size))
    for ranks in groups or ():
        made = dist.new_group(ranks)
        if ctx.rank in ranks:
            group, members = made, ranks
    place = members.index(ctx.rank)
    world = len(members)
    axis = 1 if dim is None else dim  # None: apply(x, group), the default dim
    piece, whole = list(LOCAL), whole_shape(axis, world)
    if which == "gather":
        x = seeded(100 + ctx.rank, *piece).to(ctx.device)
        c = seeded(200 + ctx.rank, *whole).to(ctx.device)
        apply = ex.AllGatherSequence.apply
    else:
        x = seeded(100 + ctx.rank, *whole).to(ctx.device)
        c = seeded(200 + ctx.rank, *piece).to(ctx.device)
        apply = ex.ReduceScatterSequence.apply
    x = x.requires_grad_(True)
    before = x.detach().clone()
    with CollectiveLog(ex) as forward:
        y = apply(x, group) if dim is None else apply(x, group, dim)
    found = {"y": y.detach(), "x_before": before, "place": place, "members": members,
             "forward": [(call.op, call.payload) for call in forward.calls], "backward": []}
    if y.shape != c.shape:  # the test reports the shape; no backward to run
        return {**found, "grad": None, "x_after": x.detach()}
    with CollectiveLog(ex) as backward:
        try:
            (y * c).sum().backward()
        except RuntimeError as error:  # autograd refuses a gradient of the wrong shape
            return {**found, "grad": None, "x_after": x.detach(), "backward_error": str(error),
                    "backward": [(call.op, call.payload) for call in backward.calls]}
    return {**found, "grad": x.grad, "x_after": x.detach(),
            "backward": [(call.op, call.payload) for call in backward.calls]}


def pieces_of(tensor: torch.Tensor, dim: int, world: int) -> list[torch.Tensor]:
    return list(tensor.chunk(world, dim=dim))


def check_calls(rank: int, got: dict, direction: str, op: str, nbytes: int, what: str) -> None:
    calls = got[direction]
    if len(got["members"]) == 1:
        return  # one rank: nothing to communicate, a shortcut is fine
    if [name for name, _ in calls] == ["all_reduce"] and op == "reduce_scatter":
        raise AssertionError(
            f"rank {rank}: {what}'s {direction} ran an all_reduce (and kept a slice): the "
            f"numbers are right, but an all-reduce sends twice a reduce-scatter's bytes and "
            f"leaves the whole sum on every rank. Use one reduce-scatter")
    assert [name for name, _ in calls] == [op], (
        f"rank {rank}: {what}'s {direction} ran {calls or 'no collective'}: expected one {op}")
    assert calls[0][1] == nbytes, (
        f"rank {rank}: {what}'s {direction} {op} moved {calls[0][1]} bytes, expected {nbytes} "
        f"(the whole sequence, {nbytes // 8} float64 values)")


@pytest.mark.task10_1
@pytest.mark.parametrize("dim", [0, 1, 2, -1, None], ids=["0", "1", "2", "-1", "default"])
@pytest.mark.parametrize("group", GROUPS)
def test_all_gather_sequence_gathers_forward_and_reduce_scatters_backward(ex, group, dim):
    """AllGatherSequence gathers every rank's tokens in rank order in the forward and
    reduce-scatters their gradient in the backward, one collective each way of the whole sequence's
    bytes: output and gradient against one process, on 1 to 4 gloo ranks, along dims 0, 1, 2, -1 and
    the default (1).

    An all-reduce where the reduce-scatter belongs is named: right numbers, twice the bytes. One
    rank needs no collective."""
    world, backend, device = group
    raise_if_untouched(ex.AllGatherSequence.forward, ex.AllGatherSequence.backward)
    results = run_on_ranks(sp_run, "gather", dim, world_size=world, backend=backend,
                           device=device)
    dim = 1 if dim is None else dim  # the default: the sequence of (batch, tokens, features)
    expected = torch.cat([seeded(100 + r, *LOCAL) for r in range(world)], dim=dim)
    weights = [seeded(200 + r, *whole_shape(dim, world)) for r in range(world)]
    summed = pieces_of(sum(weights), dim, world)
    nbytes = 8 * expected.numel()
    for rank, got in enumerate(results):
        assert_close(got["y"], expected, f"AllGatherSequence's output (dim={dim})", rank,
                     **TIGHT)
        check_calls(rank, got, "forward", "all_gather", nbytes, "AllGatherSequence")
        grad = got["grad"]
        assert grad is not None, (f"rank {rank}: x.grad is None: backward must return the "
                                  f"gradient of x, then None for group and dim")
        own = pieces_of(weights[rank], dim, world)[rank]
        why = ""
        if grad.shape == own.shape and world > 1 and torch.allclose(grad, own):
            why = (": that is this rank's own gradient for its tokens; every rank used them. "
                   "Sum over the ranks: a reduce-scatter")
        try:
            assert_close(grad, summed[rank], f"the gradient of x through AllGatherSequence "
                         f"(dim={dim})", rank, **TIGHT)
        except AssertionError as error:
            raise AssertionError(f"{error}{why}") from None
        check_calls(rank, got, "backward", "reduce_scatter", nbytes, "AllGatherSequence")


@pytest.mark.task10_1
@pytest.mark.parametrize("dim", [0, 1, 2, -1, None], ids=["0", "1", "2", "-1", "default"])
@pytest.mark.parametrize("group", GROUPS)
def test_reduce_scatter_sequence_sums_forward_and_gathers_backward(ex, group, dim):
    """ReduceScatterSequence keeps piece r of the sum over the ranks in the forward, x unchanged,
    and all-gathers the gradient in the backward, one collective each way of the whole sequence's
    bytes: against one process, on 1 to 4 gloo ranks, along dims 0, 1, 2, -1 and the default (1)."""
    world, backend, device = group
    raise_if_untouched(ex.ReduceScatterSequence.forward, ex.ReduceScatterSequence.backward)
    results = run_on_ranks(sp_run, "scatter", dim, world_size=world, backend=backend,
                           device=device)
    dim = 1 if dim is None else dim  # the default: the sequence of (batch, tokens, features)
    shape = whole_shape(dim, world)
    total = pieces_of(sum(seeded(100 + r, *shape) for r in range(world)), dim, world)
    gathered = torch.cat([seeded(200 + r, *LOCAL) for r in range(world)], dim=dim)
    nbytes = 8 * gathered.numel()
    for rank, got in enumerate(results):
        why = ""
        if got["y"].shape == total[rank].shape and world > 1 and any(
                torch.allclose(got["y"], total[other]) for other in range(world) if other != rank):
            why = ": that is another rank's piece: rank r keeps piece r, in rank order"
        try:
            assert_close(got["y"], total[rank], f"ReduceScatterSequence's output (dim={dim})",
                         rank, **TIGHT)
        except AssertionError as error:
            raise AssertionError(f"{error}{why}") from None
        assert torch.equal(got["x_after"], got["x_before"]), (
            f"rank {rank}: ReduceScatterSequence changed its input x in place: leave it as it "
            f"is (the reduce-scatter writes into a new tensor)")
        check_calls(rank, got, "forward", "reduce_scatter", nbytes, "ReduceScatterSequence")
        assert got["grad"] is not None, (f"rank {rank}: x.grad is None: backward must return "
                                         f"the gradient of x, then None for group and dim")
        assert_close(got["grad"], gathered, f"the gradient of x through ReduceScatterSequence "
                     f"(dim={dim}): every rank's gradient piece, in rank order", rank, **TIGHT)
        check_calls(rank, got, "backward", "all_gather", nbytes, "ReduceScatterSequence")


def refused_run(ctx, dim: int):
    ex = load_exercise(LESSON)
    shape = [2 * ctx.world_size] * 3
    shape[dim] = 3 * ctx.world_size + 1  # 7 tokens for 2 ranks along dim, the others divide
    x = torch.zeros(shape, device=ctx.device)
    try:
        ex.ReduceScatterSequence.apply(x, None, dim)
    except ValueError as error:
        return str(error)
    except Exception as error:  # noqa: BLE001 - what the learner's code raised instead
        return f"not a ValueError: {type(error).__name__}: {error}"
    return None


@pytest.mark.task10_1
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_reduce_scatter_sequence_refuses_a_size_that_does_not_divide(ex, dim):
    """ReduceScatterSequence raises a ValueError naming 7 and 2 for 7 tokens on 2 gloo ranks, along
    dim 0, 1 or 2."""
    raise_if_untouched(ex.ReduceScatterSequence.forward)
    for rank, message in enumerate(run_on_ranks(refused_run, dim, world_size=2)):
        assert message is not None, (
            f"rank {rank}: ReduceScatterSequence took 7 tokens for 2 ranks along dim {dim}: "
            f"raise a "
            f"ValueError before any collective (torch would fail deep inside, or cut unevenly)")
        assert not message.startswith("not a ValueError"), f"rank {rank}: {message}"
        assert "7" in message and "2" in message, (
            f"rank {rank}: the error should name the size (7) and the number of ranks (2): "
            f"{message!r}")


@pytest.mark.task10_1
@pytest.mark.parametrize("which", ["gather", "scatter"])
def test_sequence_collectives_stay_within_their_group(ex, which):
    """Both collectives with `group=` gather and sum over that group only, in the forward and in the
    backward: on 4 gloo ranks in groups [0, 2] and [1, 3], along dim 0, outputs and input gradients
    against the group's own."""
    raise_if_untouched(ex.AllGatherSequence.forward, ex.AllGatherSequence.backward,
                       ex.ReduceScatterSequence.forward, ex.ReduceScatterSequence.backward)
    groups = [[0, 2], [1, 3]]
    results = run_on_ranks(sp_run, which, 0, groups, world_size=4)
    for rank, got in enumerate(results):
        members = got["members"]
        if which == "gather":
            expected = torch.cat([seeded(100 + r, *LOCAL) for r in members], dim=0)
            what = f"AllGatherSequence's output with group={members}"
        else:
            shape = whole_shape(0, 2)
            expected = sum(seeded(100 + r, *shape) for r in members).chunk(2, 0)[got["place"]]
            what = f"ReduceScatterSequence's output with group={members}"
        why = ""
        if got["y"].shape != expected.shape:
            why = (": a shape for all 4 ranks, not for the group's 2: pass group= to the "
                   "collective")
        try:
            assert_close(got["y"], expected, what, rank, **TIGHT)
        except AssertionError as error:
            raise AssertionError(f"{error}{why}") from None
        if which == "gather":  # the sum of the group's weights over this rank's tokens
            gradient = sum(seeded(200 + r, *whole_shape(0, 2)) for r in members).chunk(
                2, 0)[got["place"]]
            what = f"AllGatherSequence's input gradient with group={members}"
        else:  # every member's weights, side by side
            gradient = torch.cat([seeded(200 + r, *LOCAL) for r in members], dim=0)
            what = f"ReduceScatterSequence's input gradient with group={members}"
        assert "backward_error" not in got, (
            f"rank {rank}: {what}: the backward failed ({got.get('backward_error', '')[:200]}): "
            f"its collective must run in the group too (keep it in ctx)")
        assert got["grad"] is not None, f"rank {rank}: no gradient reached x ({what})"
        why = ""
        if got["grad"].shape != gradient.shape:
            why = ": a backward for all 4 ranks: keep the group in ctx and pass it there too"
        try:
            assert_close(got["grad"], gradient, what + " (the backward's collective, in the "
                         "group too)", rank, **TIGHT)
        except AssertionError as error:
            raise AssertionError(f"{error}{why}") from None
