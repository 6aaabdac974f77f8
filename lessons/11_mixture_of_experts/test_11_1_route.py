"""Lesson 11, task11_1: route, top-k routing with a capacity per expert, swept against a loop
over tokens and experts written from the rule: the experts and their order, the weights and
their gradient, every kept flag; and the refusals.

    pytest lessons/11_mixture_of_experts -m task11_1
"""

from __future__ import annotations

import pytest
import torch

from harness.sweep import st, sweep
from lesson11.common import TIGHT, assert_routed_as, loop_route, seeded

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task11_1": {
        "experts: the k largest probabilities, largest first": ["test_route_matches_a_loop"],
        "weights: k >= 2, the k probabilities renormalised after the top-k, summing to 1":
            ["test_route_matches_a_loop"],
        "weights: k = 1, the probability itself, which gives the router a gradient":
            ["test_route_matches_a_loop", "test_top_1_weights_give_the_router_a_gradient"],
        "weights differentiable with respect to logits": ["test_route_matches_a_loop"],
        "kept: at most capacity per expert, first choices first, then token order":
            ["test_route_matches_a_loop", "test_capacity_serves_first_choices_first"],
        "capacity None: every assignment kept": ["test_route_matches_a_loop"],
        "k outside 1..E raises ValueError naming k and E": ["test_route_refuses_what_it_cannot_do"],
        "a negative capacity raises ValueError": ["test_route_refuses_what_it_cannot_do"],
    },
}


def weights_hint(weights: torch.Tensor, logits: torch.Tensor, k: int, kept) -> str:
    """Name the mistake a wrong answer most likely made with the weights."""
    top = logits.softmax(dim=-1).topk(k, dim=-1).values
    if k == 1 and torch.allclose(weights, torch.ones_like(weights), **TIGHT):
        return TOP_1_RENORMALISED
    if kept is not None and kept.shape == top.shape and not kept.all():
        over_kept = top * kept / (top * kept).sum(dim=-1, keepdim=True).clamp_min(1e-300)
        if torch.allclose(weights, over_kept, **TIGHT):
            return (": those are renormalised over the kept experts only; the capacity does "
                    "not change the weights: renormalise over all k chosen (for k > 1), before "
                    "the capacity drops any")
    if k > 1 and torch.allclose(weights, top, **TIGHT):
        return (": these are the softmax's probabilities as they are; for k > 1 renormalise "
                "them after the top-k, so that a token's k weights sum to 1")
    if k > 1 and not torch.allclose(weights.sum(dim=-1), torch.ones((), dtype=weights.dtype),
                                    **TIGHT):
        return ": for k > 1 a token's k weights must sum to 1"
    return ""


TOP_1_RENORMALISED = (
    ": with k = 1, renormalising makes every weight p / p = 1, and the loss then gives the "
    "router no gradient; for k = 1 keep the probability itself (Switch Transformer), and "
    "renormalise only for k > 1")


def capacity_hint(ex, got: list, want_experts: list, capacity, num_experts: int) -> str:
    """Name the mistake a wrong ``kept`` most likely made; probe ``ex.route`` where one failing
    case cannot tell two mistakes apart (capacity 0 read as no limit keeps what capacity + 1
    keeps when no expert has a second assignment)."""
    if capacity is None:
        return ""
    if got == token_major(want_experts, capacity, num_experts):
        return (": that is token by token (a token's second choice before the next token's "
                "first); every token's first choice is served before any second")
    probe = torch.tensor([[1.0, 0.0]] * 3, dtype=torch.float64)  # 3 tokens, all for expert 0
    try:
        zero, one = (ex.route(probe, 1, c)[2][:, 0].tolist() for c in (0, 1))
    except Exception:  # the failure above is the message; this was only a guess at its cause
        zero = one = None
    if zero is not None and all(zero):
        return (": capacity 0 kept every assignment, as if 0 meant no limit; only None means "
                "no limit (test `capacity is None`, not `not capacity`), and an expert with "
                "capacity 0 takes nothing")
    if zero is not None and (sum(zero), sum(one)) == (1, 2):
        return (": that keeps capacity + 1 per expert (1 at capacity 0, 2 at capacity 1): a "
                "place in the queue counts from 0; an expert takes at most capacity")
    if all(all(row) for row in got):
        return ": nothing was dropped; an expert takes at most capacity assignments"
    return ""


def token_major(experts: list[list[int]], capacity: int, num_experts: int):
    taken, kept = [0] * num_experts, []
    for row in experts:
        kept.append([])
        for e in row:
            kept[-1].append(taken[e] < capacity)
            taken[e] += taken[e] < capacity
    return kept


@pytest.mark.task11_1
@sweep(max_examples=60, tokens=st.integers(1, 12), num_experts=st.integers(1, 8),
       data=st.data(), seed=st.integers(0, 2**16))
def test_route_matches_a_loop(ex, tokens, num_experts, data, seed):
    """route equals a loop written from the rule, on 60 generated cases (1 to 12 tokens, 1 to 8
    experts, k from 1 to E, no capacity or one near the even share): the experts, largest
    probability first, the weights and their gradient by the logits, and every kept flag, in
    float64."""
    k = data.draw(st.integers(1, num_experts), label="k")
    even = -(-tokens * k // num_experts)  # an even share: capacities near it drop some
    capacity = data.draw(st.one_of(st.none(), st.integers(0, even + 1),
                                   st.integers(0, tokens * k)), label="capacity")
    logits = (seeded(seed, tokens, num_experts) * 3).requires_grad_(True)
    experts, weights, kept = ex.route(logits, k, capacity)
    want_experts, want_weights, want_kept = loop_route(logits, k, capacity)
    where = f"route(logits of {tokens} tokens x {num_experts} experts, k={k}, capacity={capacity})"
    assert tuple(experts.shape) == (tokens, k), f"{where}: experts is {tuple(experts.shape)}, " \
                                                f"expected ({tokens}, {k})"
    assert_routed_as(
        where, experts, weights, want_experts, want_weights, logits, seeded(seed + 1, tokens, k),
        order="probability", weights_hint=lambda: weights_hint(weights.detach(), logits.detach(),
                                                                k, kept),
        graph_hint="keep them in the graph (no .detach(), no torch.no_grad(), no .tolist())")
    assert kept.dtype == torch.bool, f"{where}: kept is {kept.dtype}, expected torch.bool"
    if kept.tolist() != want_kept:
        hint = capacity_hint(ex, kept.tolist(), want_experts, capacity, num_experts)
        raise AssertionError(f"{where}: kept {kept.tolist()}, expected {want_kept}{hint}")


@pytest.mark.task11_1
def test_top_1_weights_give_the_router_a_gradient(ex):
    """With k = 1, route's weights give the router a gradient (above 1e-3 for these logits): a
    token's weight is its expert's probability p, as in Switch Transformer, not p / p = 1.

    Renormalised, the weight would be 1 for every token, and the router would learn nothing from the
    loss (only from the load-balancing loss)."""
    logits = (seeded(3, 6, 4) * 3).requires_grad_(True)
    _, weights, _ = ex.route(logits, 1)
    assert weights.requires_grad, (
        "route(logits, k=1): the weights are not differentiable with respect to logits; keep "
        "them in the graph")
    (grad,) = torch.autograd.grad((weights * seeded(4, 6, 1)).sum(), logits)
    largest = grad.abs().max().item()  # d p / d logit = p (1 - p): far from 0 for these logits
    assert largest > 1e-3, (
        f"route(logits, k=1): the weights' gradient by the logits is at most {largest:.1e}"
        f"{TOP_1_RENORMALISED}")


@pytest.mark.task11_1
def test_capacity_serves_first_choices_first(ex):
    """At capacity 1, of two tokens with opposite preferences between 2 experts, route keeps each
    token's first choice and drops both second choices: every token's first choice is served before
    any second.

    Served token by token instead, token 0's second choice would take expert 1's only place before
    token 1's first choice."""
    logits = torch.tensor([[2.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
    experts, _, kept = ex.route(logits, 2, 1)
    assert experts.tolist() == [[0, 1], [1, 0]], f"experts {experts.tolist()}"
    if kept.tolist() == [[True, True], [False, False]]:
        raise AssertionError(
            "route(..., k=2, capacity=1) served token by token: token 0's second choice took "
            "expert 1's place before token 1's first choice; every token's first choice is "
            "served before any second choice")
    assert kept.tolist() == [[True, False], [True, False]], (
        f"route(..., k=2, capacity=1) kept {kept.tolist()}, expected [[True, False], "
        f"[True, False]]: each expert takes the one token whose first choice it is")


@pytest.mark.task11_1
@pytest.mark.parametrize("k, capacity", [(0, None), (4, None), (-1, None), (2, -1)])
def test_route_refuses_what_it_cannot_do(ex, k, capacity):
    """route raises a ValueError for k = 0, 4 and -1 with 3 experts, naming k and 3, and for a
    capacity of -1."""
    logits = seeded(0, 5, 3)
    with pytest.raises(ValueError) as raised:
        ex.route(logits, k, capacity)
    if capacity is None:
        assert str(k) in str(raised.value) and "3" in str(raised.value), (
            f"route(k={k}) with 3 experts: the message should name k ({k}) and E (3): "
            f"{raised.value}")
