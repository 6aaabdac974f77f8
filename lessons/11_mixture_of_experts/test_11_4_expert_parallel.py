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
from lesson11.common import GROUPS, LESSON, TIGHT, loop_route, my_group, seeded

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


def routing(member: int, num_experts: int, k: int, capacity, idle: bool):
    """Rank ``member``'s tokens, routing (from the loop) and loss weights."""
    logits = seeded(50 + member, TOKENS, num_experts)
    if idle:  # nobody chooses the last expert
        logits[:, -1] = -1e3
    experts, weights, kept = loop_route(logits, k, capacity)
    return (seeded(60 + member, TOKENS, WIDTH), torch.tensor(experts),
            torch.stack([torch.stack(row) for row in weights]).detach(), torch.tensor(kept),
            seeded(70 + member, TOKENS, WIDTH))


def loop_layer(tokens, experts, weights, kept, every_expert):
    return torch.stack([sum((weights[t, j] * every_expert[int(experts[t, j])](tokens[t])
                             for j in range(experts.shape[1]) if kept[t, j]),
                            torch.zeros(WIDTH, dtype=torch.float64))
                        for t in range(tokens.shape[0])])


def ep_run(ctx, num_experts: int, k: int, capacity, idle: bool, groups=None) -> dict:
    ex = load_exercise(LESSON)
    group, members = my_group(ctx, groups)
    place, world = members.index(ctx.rank), len(members)
    mine = num_experts // world
    tokens, experts, weights, kept, c = routing(ctx.rank, num_experts, k, capacity, idle)
    tokens = tokens.to(ctx.device).requires_grad_(True)
    weights = weights.to(ctx.device).requires_grad_(True)
    block = make_experts(num_experts)[place * mine:(place + 1) * mine].to(ctx.device)
    with CollectiveLog(ex) as forward:
        out = ex.expert_parallel_forward(tokens, experts.to(ctx.device), weights,
                                         kept.to(ctx.device), block, num_experts,
                                         *([group] if groups else []))
    found = {"out": out.detach(), "members": members, "tokens_grad": None,
             "forward": [(call.op, call.payload) for call in forward.calls], "backward": []}
    if out.shape != c.shape:
        return found
    with CollectiveLog(ex) as backward:
        (out * c.to(ctx.device)).sum().backward()
    found.update(tokens_grad=tokens.grad, weights_grad=weights.grad,
                 expert_grads=[[p.grad for p in e.parameters()] for e in block],
                 backward=[(call.op, call.payload) for call in backward.calls])
    # The reference: every member's tokens through the loop, one loss.
    every_expert = make_experts(num_experts)
    total, mine_ref = 0.0, None
    for s, member in enumerate(members):
        t_s, e_s, w_s, k_s, c_s = routing(member, num_experts, k, capacity, idle)
        t_s.requires_grad_(True)
        w_s.requires_grad_(True)
        y_s = loop_layer(t_s, e_s, w_s, k_s, every_expert)
        total = total + (y_s * c_s).sum()
        if s == place:
            mine_ref = (y_s.detach(), t_s, w_s)
    total.backward()
    found["want"] = {"out": mine_ref[0], "tokens_grad": mine_ref[1].grad,
                     "weights_grad": mine_ref[2].grad,
                     "expert_grads": [[p.grad for p in e.parameters()] for e in
                                      every_expert[place * mine:(place + 1) * mine]]}
    found["routed"] = [int(((e_s >= place * mine) & (e_s < (place + 1) * mine) & k_s).sum())
                       for e_s, k_s in (routing(m, num_experts, k, capacity, idle)[1:4:2]
                                        for m in members)]
    found["sent"] = int(kept.sum())
    return found


def out_hint(found: dict, world: int) -> str:
    if world > 1:
        return (": rows came back to the wrong assignments? They arrive grouped by source rank, "
                "then by expert: regroup them by local expert before running the experts, and "
                "put each result back in arrival order before the second all-to-all")
    return ""


@pytest.mark.task11_4
@pytest.mark.parametrize("k, capacity, idle", [(1, None, False), (2, None, True), (2, 3, False)],
                         ids=["top-1", "top-2, an idle expert", "top-2, capacity 3"])
@pytest.mark.parametrize("group_case", [g for g in GROUPS if g.values[0][0] in (1, 2, 4)]
                         + [pytest.param("subgroups", id="subgroups")])
def test_expert_parallel_is_the_loop_over_every_ranks_tokens(group_case, k, capacity, idle):
    if group_case == "subgroups":
        world, backend, device, groups = 4, "gloo", "cpu", [[0, 2], [1, 3]]
    else:
        (world, backend, device), groups = group_case, None
    members = 2 if groups else world
    num_experts = 2 * members if members > 1 else 3
    results = run_on_ranks(ep_run, num_experts, k, capacity, idle, groups, world_size=world,
                           backend=backend, device=device)
    for rank, found in enumerate(results):
        where = (f"rank {rank} (group {found['members']}), {num_experts} experts, top-{k}, "
                 f"capacity {capacity}")
        want = found.get("want")
        if want is None:
            raise AssertionError(f"{where}: expert_parallel_forward returned "
                                 f"{tuple(found['out'].shape)}, expected ({TOKENS}, {WIDTH})")
        got = found["out"].cpu()
        if not torch.allclose(got, want["out"], **TIGHT):
            hint = out_hint(found, members)
            plain = (want["out"] - got).abs().max().item()
            raise AssertionError(f"{where}: the output differs from the loop over tokens by up "
                                 f"to {plain:.2e}{hint}")
        assert_close(found["tokens_grad"].cpu(), want["tokens_grad"],
                     f"{where}: the gradient of tokens", **TIGHT)
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
        received = sum(found["routed"])
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
    for rank, message in enumerate(run_on_ranks(refusal_run, world_size=2, timeout=60)):
        assert message, (f"rank {rank}: 2 local experts for 6 experts on 2 ranks did not raise "
                         f"ValueError: check len(local_experts) before any exchange")
        assert "2" in message and "3" in message, (
            f"rank {rank}: the message should name both numbers (2 given, 3 a rank): {message}")
