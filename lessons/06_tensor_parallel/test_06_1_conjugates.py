"""Lesson 06, task6_1: the conjugates f and g (CopyToParallel, ReduceFromParallel). f passes x
through and all-reduces its gradient in backward, g all-reduces x in forward and passes its
gradient through: each communicates once, on a copy, within its group only. On gloo/CPU ranks
(and on CUDA where present).

    pytest lessons/06_tensor_parallel -m task6_1
"""

from __future__ import annotations

import pytest
import torch

from harness.collectives import CollectiveLog
from harness.compare import assert_close
from harness.exercises import load_exercise, raise_if_untouched
from harness.ranks import run_on_ranks
from lesson06.common import GROUPS, LESSON, SHAPE, pair_run, rank_weights

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task6_1": {
        "CopyToParallel forward: x unchanged, no communication":
            ["test_copy_to_parallel_sums_the_gradient_in_backward"],
        "CopyToParallel backward: the sum over the group's ranks of the gradients, an all-reduce":
            ["test_copy_to_parallel_sums_the_gradient_in_backward"],
        "CopyToParallel: the group's ranks only": [
            "test_conjugates_reduce_within_their_group_only"],
        "CopyToParallel backward returns (gradient, None)":
            ["test_copy_to_parallel_sums_the_gradient_in_backward"],
        "all-reduce a copy, never the tensor autograd hands in":
            ["test_copy_to_parallel_sums_the_gradient_in_backward"],
        "ReduceFromParallel forward: the sum over the group's ranks of x, an all-reduce":
            ["test_reduce_from_parallel_sums_in_forward_only",
             "test_conjugates_reduce_within_their_group_only"],
        "ReduceFromParallel forward: all-reduce a copy":
            ["test_reduce_from_parallel_sums_in_forward_only"],
        "ReduceFromParallel backward: the gradient unchanged, no communication; (gradient, None)":
            ["test_reduce_from_parallel_sums_in_forward_only"],
    },
}


def conjugate_run(ctx, which: str, *, residual: bool):
    """``which`` of f and g on this rank, forward and backward, with the collectives counted.

    f: x is the same on every rank; the loss is (f(x) * c_rank).sum(), so the whole gradient of
    x is the sum of every rank's c. With ``residual`` the loss is ((f(x) + x) * c).sum(), where
    autograd gives f's backward and x's other path the same gradient tensor.
    g: x differs on every rank; the loss is (g(x) * c).sum() with c the same everywhere.
    """
    ex = load_exercise(LESSON)
    device = ctx.device
    if which == "f":
        base = rank_weights(-1, SHAPE).to(device)
        c = rank_weights(ctx.rank, SHAPE).to(device)
        apply = ex.CopyToParallel.apply
    else:
        base = rank_weights(100 + ctx.rank, SHAPE).to(device)
        c = rank_weights(-1, SHAPE).to(device)
        apply = ex.ReduceFromParallel.apply
    x = base.clone().requires_grad_(True)
    with CollectiveLog(ex) as forward:
        y = apply(x, None)
    out = y + x if residual else y
    with CollectiveLog(ex) as backward:
        (out * c).sum().backward()
    return {"y": y.detach(), "x_after": x.detach(), "base": base, "grad": x.grad,
            "forward": [(call.op, call.payload) for call in forward.calls],
            "backward": [(call.op, call.payload) for call in backward.calls]}


def conjugate_diagnosis(grad: torch.Tensor, expected: torch.Tensor, own: torch.Tensor,
                        world: int) -> str:
    if torch.allclose(grad, own, atol=1e-5) and not torch.allclose(own, expected, atol=1e-5):
        return (f": it is this rank's own part only; the other {world - 1} rank(s)' parts "
                f"are missing. f's backward must all-reduce (sum) the gradient")
    if torch.allclose(grad, world * expected, rtol=1e-4, atol=1e-5):
        return (f": it is {world}x the expected one: one all-reduce too many in backward "
                f"(f's backward all-reduces once; g's passes the gradient through)")
    return ""


@pytest.mark.task6_1
@pytest.mark.parametrize("residual", [False, True], ids=["alone", "beside-a-residual"])
@pytest.mark.parametrize("group", GROUPS)
def test_copy_to_parallel_sums_the_gradient_in_backward(ex, group, residual):
    """CopyToParallel (f) returns x unchanged with no collective in the forward, and in the backward
    all-reduces a copy of the gradient once: x's gradient against the sum of every rank's upstream
    gradient, on 2 and 4 gloo ranks, alone and beside a residual connection that shares the gradient
    tensor.

    Each rank has a different upstream gradient; the all-reduce's bytes are those of x's gradient. A
    rank's own part only, W times the sum, and the residual path's gradient all-reduced too are each
    named."""
    world, backend, device = group
    raise_if_untouched(ex.CopyToParallel.forward, ex.CopyToParallel.backward)
    results = run_on_ranks(conjugate_run, "f", residual=residual, world_size=world, backend=backend,
                           device=device)
    total = sum(rank_weights(r, SHAPE) for r in range(world))
    nbytes = 4 * total.numel()
    for rank, got in enumerate(results):
        assert_close(got["y"], got["base"], "CopyToParallel's forward output (x, unchanged)",
                     rank)
        assert not got["forward"], (
            f"rank {rank}: CopyToParallel's forward ran {got['forward']}: every rank already "
            f"holds x whole, the forward communicates nothing")
        # With the residual, x's own path adds this rank's c once more, unreduced.
        own = rank_weights(rank, SHAPE)
        expected = total + own if residual else total
        grad = got["grad"]
        if grad is None:
            raise AssertionError(f"rank {rank}: x.grad is None: the backward must return the "
                                 f"gradient of x (and None for the group)")
        why = conjugate_diagnosis(grad, expected, own * (2 if residual else 1), world)
        if residual and not why and torch.allclose(grad, 2 * total, atol=1e-4):
            why = (": the residual path's gradient was all-reduced too: f's backward changed "
                   "the gradient tensor autograd handed in, which the residual path shares. "
                   "All-reduce a copy (grad.clone())")
        try:
            assert_close(grad, expected, "the gradient of x through CopyToParallel", rank)
        except AssertionError as error:
            raise AssertionError(f"{error}{why}") from None
        assert [op for op, _ in got["backward"]] == ["all_reduce"], (
            f"rank {rank}: CopyToParallel's backward ran {got['backward'] or 'no collective'}: "
            f"expected one all_reduce of the gradient")
        assert got["backward"][0][1] == nbytes, (
            f"rank {rank}: the backward all-reduced {got['backward'][0][1]} bytes, expected "
            f"{nbytes} (the gradient of x, {SHAPE} fp32)")


@pytest.mark.task6_1
@pytest.mark.parametrize("group", GROUPS)
def test_reduce_from_parallel_sums_in_forward_only(ex, group):
    """ReduceFromParallel (g) all-reduces a copy of x once in the forward (x itself unchanged) and
    passes the gradient through with no collective in the backward: its output against the sum of
    every rank's x, x's gradient against the upstream one, on 2 and 4 gloo ranks."""
    world, backend, device = group
    raise_if_untouched(ex.ReduceFromParallel.forward, ex.ReduceFromParallel.backward)
    results = run_on_ranks(conjugate_run, "g", residual=False, world_size=world, backend=backend,
                           device=device)
    total = sum(rank_weights(100 + r, SHAPE) for r in range(world))
    upstream = rank_weights(-1, SHAPE)
    for rank, got in enumerate(results):
        assert [op for op, _ in got["forward"]] == ["all_reduce"], (
            f"rank {rank}: ReduceFromParallel's forward ran {got['forward'] or 'no collective'}"
            f": expected one all_reduce, the sum of every rank's partial result")
        assert_close(got["y"], total, "ReduceFromParallel's forward (the sum over ranks)", rank)
        if not torch.equal(got["x_after"], got["base"]):
            raise AssertionError(f"rank {rank}: ReduceFromParallel's forward changed its input "
                                 f"x in place: all-reduce a copy (x.clone())")
        assert not got["backward"], (
            f"rank {rank}: ReduceFromParallel's backward ran {got['backward']}: the gradient "
            f"of a sum with respect to each term is the sum's own gradient, no communication")
        try:
            assert_close(got["grad"], upstream, "the gradient of x through ReduceFromParallel",
                         rank)
        except AssertionError as error:
            raise AssertionError(f"{error}. The backward passes the gradient through "
                                 f"unchanged") from None


def pair_diagnosis(got: torch.Tensor, everyone: torch.Tensor) -> str:
    if torch.allclose(got, everyone, atol=1e-5):
        return (": that is the sum over all 4 ranks, not over this rank's group of 2. Pass "
                "group= to dist.all_reduce")
    return ""


@pytest.mark.task6_1
def test_conjugates_reduce_within_their_group_only(ex):
    """f and g with `group=` sum over that group only: on 4 gloo ranks in two groups of 2, each
    group on data of its own, f's input gradient and g's output are the sums over the pair, not over
    all 4 ranks."""
    raise_if_untouched(ex.CopyToParallel.backward, ex.ReduceFromParallel.forward)
    results = run_on_ranks(pair_run, "conjugates", world_size=4)
    for rank, got in enumerate(results):
        mates = [2 * (rank // 2), 2 * (rank // 2) + 1]
        for key, offset, what in (("f_grad", 0, "the gradient through CopyToParallel"),
                                  ("g_out", 100, "ReduceFromParallel's output")):
            expected = sum(rank_weights(offset + r, SHAPE) for r in mates)
            everyone = sum(rank_weights(offset + r, SHAPE) for r in range(4))
            try:
                assert_close(got[key], expected, f"{what} with group={mates}", rank)
            except AssertionError as error:
                raise AssertionError(f"{error}{pair_diagnosis(got[key], everyone)}") from None
