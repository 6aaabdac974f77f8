"""Lesson 11, task11_4: expert_parallel_forward, one MoE layer with this rank's block of experts.
Every rank builds every rank's tokens, routing and the same experts from seeds, so each checks
its output, and the gradients of its tokens, its gate weights and the experts it holds, against
a loop over all ranks' tokens and every expert in one process. On gloo/CPU ranks, 1 to 4 of
them and a subgroup (and on nccl where GPUs are present).

    pytest lessons/11_mixture_of_experts -m task11_4
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from harness.collectives import CollectiveLog
from harness.compare import assert_close
from harness.exercises import load_exercise
from harness.ranks import run_on_ranks
from lesson11.common import GROUPS, LESSON, TIGHT, everyone_agrees, loop_route, my_group, seeded

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task11_4": {
        "returns (T, C): the sum over kept assignments of weight x expert(token)":
            ["test_expert_parallel_is_the_loop_over_every_ranks_tokens"],
        "a dropped assignment adds 0": ["test_expert_parallel_is_the_loop_over_every_ranks_tokens"],
        "rank r of group holds experts r E / W onwards (None: every rank)":
            ["test_expert_parallel_is_the_loop_over_every_ranks_tokens"],
        "gradients reach tokens, weights and the local experts":
            ["test_expert_parallel_is_the_loop_over_every_ranks_tokens"],
        "each local expert runs once, on all its rows; one that received none may be skipped":
            ["test_expert_parallel_is_the_loop_over_every_ranks_tokens"],
        "the counts, the rows there and back: three all-to-alls forward, two backward":
            ["test_expert_parallel_is_the_loop_over_every_ranks_tokens"],
        "local_experts of the wrong length raise ValueError naming both numbers":
            ["test_expert_parallel_refuses_the_wrong_block"],
    },
}

TOKENS, WIDTH = 10, 4


def make_experts(num_experts: int) -> nn.ModuleList:
    """The same E small MLPs on every rank and in the reference, in float64."""
    generator = torch.Generator().manual_seed(7)
    experts = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(),
                                          nn.Linear(2 * WIDTH, WIDTH))
                            for _ in range(num_experts)).double()
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64))
    return experts


def routing(member: int, num_experts: int, k: int, capacity, idle: int):
    """Rank ``member``'s tokens, routing (from the loop) and loss weights; nobody chooses the
    last ``idle`` experts."""
    logits = seeded(50 + member, TOKENS, num_experts)
    if idle:
        logits[:, num_experts - idle:] = -1e3
    experts, weights, kept = loop_route(logits, k, capacity)
    return (seeded(60 + member, TOKENS, WIDTH), torch.tensor(experts),
            torch.stack([torch.stack(row) for row in weights]).detach(), torch.tensor(kept),
            seeded(70 + member, TOKENS, WIDTH))


def loop_layer(tokens, experts, weights, kept, every_expert, dropped=None):
    """The layer, token by token. ``dropped``: what a dropped assignment's slot holds (0, or
    the token for the wrong answer that passes it through); weights=None: unweighted."""
    def term(t, j):
        if kept[t, j]:
            result = every_expert[int(experts[t, j])](tokens[t])
        else:
            result = tokens[t] if dropped == "token" else torch.zeros(WIDTH, dtype=torch.float64)
        return result if weights is None else weights[t, j] * result

    return torch.stack([sum((term(t, j) for j in range(experts.shape[1])),
                            torch.zeros(WIDTH, dtype=torch.float64))
                        for t in range(tokens.shape[0])])


def ep_run(ctx, num_experts: int, k: int, capacity, idle: int, groups=None) -> dict:
    ex = load_exercise(LESSON)
    group, members = my_group(ctx, groups)
    place, world = members.index(ctx.rank), len(members)
    mine = num_experts // world
    tokens, experts, weights, kept, c = routing(ctx.rank, num_experts, k, capacity, idle)
    tokens = tokens.to(ctx.device).requires_grad_(True)
    weights = weights.to(ctx.device).requires_grad_(True)
    block = make_experts(num_experts)[place * mine:(place + 1) * mine].to(ctx.device)
    calls = [[] for _ in range(mine)]  # each local expert's runs: the rows of each
    for j, expert in enumerate(block):
        expert.register_forward_hook(lambda _, args, __, j=j: calls[j].append(len(args[0])))
    with CollectiveLog(ex) as forward:
        try:
            out = ex.expert_parallel_forward(tokens, experts.to(ctx.device), weights,
                                             kept.to(ctx.device), block, num_experts,
                                             *([group] if groups else []))
        except ValueError as error:
            if not groups:
                raise
            raise AssertionError(
                f"expert_parallel_forward raised ValueError in a group of {world} of "
                f"{ctx.world_size} ranks ({error}): use the group's size and rank, "
                f"dist.get_world_size(group), in every call") from None
    found = {"out": out.detach(), "members": members, "calls": calls, "backward": [],
             "forward": [(call.op, call.payload) for call in forward.calls],
             "needs_grad": out.requires_grad}
    if not everyone_agrees(ctx, out.shape == c.shape and out.requires_grad):
        return found  # some rank's output cannot go through the backward: the test says why
    with CollectiveLog(ex) as backward:
        (out * c.to(ctx.device)).sum().backward()
    found.update(tokens_grad=tokens.grad, weights_grad=weights.grad,
                 expert_grads=[[p.grad for p in e.parameters()] for e in block],
                 backward=[(call.op, call.payload) for call in backward.calls])
    # The reference: every member's tokens through the loop, one loss.
    every_expert = make_experts(num_experts)
    total, mine_ref, received = 0.0, None, 0
    held = slice(place * mine, (place + 1) * mine)
    found["rows"] = [0] * mine  # what every member sends each of my experts
    for s, member in enumerate(members):
        t_s, e_s, w_s, k_s, c_s = routing(member, num_experts, k, capacity, idle)
        received += int(((e_s >= held.start) & (e_s < held.stop) & k_s).sum())  # rows for me
        for j in range(mine):
            found["rows"][j] += int(((e_s == held.start + j) & k_s).sum())
        t_s.requires_grad_(True)
        w_s.requires_grad_(True)
        y_s = loop_layer(t_s, e_s, w_s, k_s, every_expert)
        total = total + (y_s * c_s).sum()
        if s == place:
            mine_ref = (y_s.detach(), t_s, w_s)
            with torch.no_grad():
                found["unweighted"] = loop_layer(t_s, e_s, None, k_s, every_expert)
                found["passed_through"] = loop_layer(t_s, e_s, w_s, k_s, every_expert, "token")
                over_kept = w_s * k_s / (w_s * k_s).sum(dim=-1, keepdim=True).clamp_min(1e-300)
                found["over_kept"] = loop_layer(t_s, e_s, over_kept, k_s, every_expert)
    if total.requires_grad:  # everything dropped: nothing to differentiate, every gradient 0
        total.backward()
    found["want"] = {"out": mine_ref[0],
                     "tokens_grad": torch.zeros_like(mine_ref[1]) if mine_ref[1].grad is None
                     else mine_ref[1].grad,
                     "weights_grad": torch.zeros_like(mine_ref[2]) if mine_ref[2].grad is None
                     else mine_ref[2].grad,
                     "expert_grads": [[p.grad for p in e.parameters()]
                                      for e in every_expert[held]]}
    found["received"], found["sent"] = received, int(kept.sum())
    return found


def out_hint(found: dict, got: torch.Tensor, world: int) -> str:
    """Name the mistake when the output is one a known mistake gives; a guess only as one."""
    # With top-1 and nothing dropped both give expert(token): the weights' gradient tells them
    # apart (0 after renormalising, none at all unweighted).
    if torch.allclose(got, found["over_kept"], **TIGHT) and found["weights_grad"] is not None:
        return (": those weights are renormalised over the kept assignments; use route's "
                "weights as they are (the capacity does not change them): a dropped "
                "assignment adds 0, and the others keep their weight")
    if torch.allclose(got, found["unweighted"], **TIGHT):
        return ": that is the sum of the experts' outputs unweighted; weigh each by its weight"
    if torch.allclose(got, found["passed_through"], **TIGHT):
        return (": a dropped assignment added the token itself; it adds 0 (the block's "
                "residual already carries the token)")
    if world > 1:
        return (": did rows come back to the wrong assignments? They arrive grouped by source "
                "rank, then by expert: regroup them by local expert before running the "
                "experts, and put each result back in arrival order before the second "
                "all-to-all")
    return ""


@pytest.mark.task11_4
@pytest.mark.parametrize("k, capacity, idle", [
    (1, None, 0), (2, None, 1), (2, 3, 0), (1, None, "a rank's block"), (2, 0, 0)],
    ids=["top-1", "top-2, an idle expert", "top-2, capacity 3", "top-1, a rank gets nothing",
         "top-2, capacity 0"])
@pytest.mark.parametrize("group_case", [g for g in GROUPS if g.values[0][0] in (1, 2, 4)]
                         + [pytest.param("subgroups", id="subgroups")])
def test_expert_parallel_is_the_loop_over_every_ranks_tokens(group_case, k, capacity, idle):
    """expert_parallel_forward equals a loop over every rank's tokens in one process: the output and
    the gradients of the tokens, the weights and each local expert, on 1, 2 and 4 gloo ranks and
    groups of 2 in 4; top-1 and top-2, with drops, an idle expert, a rank that receives nothing,
    capacity 0.

    Each local expert runs once on all its rows (one that received none may be skipped). The forward
    runs three all-to-alls (the counts, the kept rows, what comes back) and the backward two, each
    of exactly the bytes planned."""
    if group_case == "subgroups":
        world, backend, device, groups = 4, "gloo", "cpu", [[0, 2], [1, 3]]
    else:
        (world, backend, device), groups = group_case, None
    members = 2 if groups else world
    num_experts = 2 * members if members > 1 else 3
    if idle == "a rank's block":  # the last rank's experts: that rank receives no row
        idle = num_experts // members if members > 1 else 1
    results = run_on_ranks(ep_run, num_experts, k, capacity, idle, groups, world_size=world,
                           backend=backend, device=device)
    for rank, found in enumerate(results):
        where = (f"rank {rank} (group {found['members']}), {num_experts} experts, top-{k}, "
                 f"capacity {capacity}, {idle} idle")
        if tuple(found["out"].shape) != (TOKENS, WIDTH):
            raise AssertionError(f"{where}: expert_parallel_forward returned "
                                 f"{tuple(found['out'].shape)}, expected ({TOKENS}, {WIDTH})")
        if not found["needs_grad"]:
            raise AssertionError(f"{where}: the output is not differentiable: send the rows with "
                                 f"AllToAll (dist.all_to_all_single has no autograd) and keep "
                                 f"the weights in the graph")
        if "want" not in found:
            raise AssertionError(f"{where}: another rank's output could not go through the "
                                 f"backward (see its message)")
        want = found["want"]
        got = found["out"].cpu()
        if not torch.allclose(got, want["out"], **TIGHT):
            hint = out_hint(found, got, members)
            plain = (want["out"] - got).abs().max().item()
            raise AssertionError(f"{where}: the output differs from the loop over tokens by up "
                                 f"to {plain:.2e}{hint}")
        if found["tokens_grad"] is None:
            raise AssertionError(f"{where}: no gradient reached tokens: send the rows with "
                                 f"AllToAll (dist.all_to_all_single has no autograd), and keep "
                                 f"what goes back in the graph even when no row arrived")
        assert_close(found["tokens_grad"].cpu(), want["tokens_grad"],
                     f"{where}: the gradient of tokens", **TIGHT)
        for j, (runs, rows) in enumerate(zip(found["calls"], found["rows"], strict=True)):
            if runs != [rows] and not (rows == 0 and runs in ([], [0])):
                raise AssertionError(
                    f"{where}: local expert {j} ran {len(runs)} times, on {runs} rows; "
                    f"{rows} rows arrived for it: run each expert once, on every row that "
                    f"arrived for it from any rank (one large product, not one per source "
                    f"rank); one that received none may be skipped")
        if found["weights_grad"] is None:
            raise AssertionError(f"{where}: no gradient reached the weights: multiply the rows "
                                 f"that came back by weights inside the graph")
        assert_close(found["weights_grad"].cpu(), want["weights_grad"],
                     f"{where}: the gradient of the weights", **TIGHT)
        for e, (g_list, w_list) in enumerate(zip(found["expert_grads"], want["expert_grads"],
                                                 strict=True)):
            for g, w in zip(g_list, w_list, strict=True):  # None: no token reached it
                if g is None and w is None:
                    continue
                g = torch.zeros_like(w if w is not None else g) if g is None else g.cpu()
                w = torch.zeros_like(g) if w is None else w
                assert_close(g, w, f"{where}: local expert {e}'s gradient (every rank's tokens "
                             f"routed to it)", **TIGHT)
        row = WIDTH * 8
        received = found["received"]
        want_f = [("all_to_all", num_experts * 8), ("all_to_all", found["sent"] * row),
                  ("all_to_all", received * row)]
        want_b = [("all_to_all", found["sent"] * row), ("all_to_all", received * row)]
        assert found["forward"] == want_f, (
            f"{where}: the forward called {found['forward']}, expected {want_f}: the counts, "
            f"the kept rows there, what arrived back")
        assert found["backward"] == want_b, (
            f"{where}: the backward called {found['backward']}, expected {want_b}")


def refusal_run(ctx) -> str:
    ex = load_exercise(LESSON)
    tokens = seeded(0, 4, WIDTH)
    experts = torch.zeros(4, 1, dtype=torch.int64)
    kept = torch.ones(4, 1, dtype=torch.bool)
    try:
        ex.expert_parallel_forward(tokens, experts, torch.ones(4, 1, dtype=torch.float64), kept,
                                   make_experts(2), 6)
    except ValueError as error:
        return str(error)
    return ""


@pytest.mark.task11_4
def test_expert_parallel_refuses_the_wrong_block():
    """expert_parallel_forward raises a ValueError naming 2 and 3 when given 2 local experts for 6
    experts on 2 gloo ranks, before any exchange."""
    for rank, message in enumerate(run_on_ranks(refusal_run, world_size=2, timeout=60)):
        assert message, (f"rank {rank}: 2 local experts for 6 experts on 2 ranks did not raise "
                         f"ValueError: check len(local_experts) before any exchange")
        assert "2" in message and "3" in message, (
            f"rank {rank}: the message should name both numbers (2 given, 3 a rank): {message}")
