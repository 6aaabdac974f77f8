"""Lesson 11, task11_5: sync_gradients, which ranks average which gradient when the experts are
data parallel too. Every rank's gradients are made from seeds, so the test works out each rank's
expected result by hand (a mean over the group for what every rank holds, a sum over the copies
divided by W for an expert) and names the mistake when a result is another rule's. On gloo/CPU
ranks: 1, 2 and 4 of them, pure expert parallel, pure data parallel, 2 x 2, and two groups side
by side.

    pytest lessons/11_mixture_of_experts -m task11_5
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from harness.compare import assert_close
from harness.exercises import load_exercise, raise_if_untouched
from harness.ranks import run_on_ranks
from lesson11.common import LESSON, TIGHT, my_group, seeded

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task11_5": {
        "replicated: the mean over group": [
            "test_replicated_gradients_become_the_mean_over_the_group"],
        "experts: the sum over copies, divided by W (not by the copies)": [
            "test_expert_gradients_become_the_sum_over_copies_divided_by_w"],
        "copies=None: no other rank holds them (only divided by W)": [
            "test_expert_gradients_become_the_sum_over_copies_divided_by_w"],
        "W: the ranks of group (None: every rank)": [
            "test_replicated_gradients_become_the_mean_over_the_group",
            "test_expert_gradients_become_the_sum_over_copies_divided_by_w"],
        "each .grad changed in place, None returned": [
            "test_gradients_change_in_place"],
    },
}

# name -> (world size, groups side by side (None: one group of every rank), the copies: the
# lists of ranks that hold the same experts (None: each rank holds its own))
LAYOUTS = {
    "one rank": (1, None, None),
    "ep 2": (2, None, None),
    "dp 2, every rank a copy": (2, None, [[0, 1]]),
    "dp 2 x ep 2": (4, None, [[0, 2], [1, 3]]),
    "ep 4": (4, None, None),
    "two groups of ep 2": (4, [[0, 1], [2, 3]], None),
    "two groups of dp 2": (4, [[0, 1], [2, 3]], [[0, 1], [2, 3]]),
}
CASES = 5  # generated parameter lists per layout


def shapes(case: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The replicated parameters' shapes and the experts' (the same on every rank): case 0 has
    three of each, of three shapes, so that every parameter must be synchronised, in its order;
    the others 0 to 3 of each, of 1 or 2 dimensions."""
    if case == 0:
        return [(3,), (2, 4), (1,)], [(4, 2), (5,), (2, 2)]
    g = torch.Generator().manual_seed(1000 + case)
    def some() -> list[tuple[int, ...]]:
        count = int(torch.randint(0, 4, (), generator=g))
        return [tuple(int(n) for n in torch.randint(1, 5, (int(torch.randint(1, 3, (),
                generator=g)),), generator=g)) for _ in range(count)]
    return some(), some()


def gradient(case: int, rank: int, kind: str, index: int, shape) -> torch.Tensor:
    return seeded(10_000 * case + 100 * rank + 10 * ("replicated", "experts").index(kind) + index,
                  *shape)


def sync_run(ctx, layout: str) -> list[dict]:
    ex = load_exercise(LESSON)
    _, groups, copies_lists = LAYOUTS[layout]
    group, members = my_group(ctx, groups)
    copies = None
    for ranks in copies_lists or ():
        made = dist.new_group(ranks)
        if ctx.rank in ranks:
            copies = made
    found = []
    for case in range(CASES):
        made = {}
        for kind, kind_shapes in zip(("replicated", "experts"), shapes(case), strict=True):
            made[kind] = []
            for index, shape in enumerate(kind_shapes):
                parameter = torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64))
                parameter.grad = gradient(case, ctx.rank, kind, index, shape)
                made[kind].append(parameter)
        grads = [p.grad for kind in made.values() for p in kind]
        pointers = [g.data_ptr() for g in grads]
        arguments = {} if copies is None else {"copies": copies}
        if group is not None:
            arguments["group"] = group
        returned = ex.sync_gradients(made["replicated"], made["experts"], **arguments)
        found.append({"replicated": [p.grad.clone() for p in made["replicated"]],
                      "experts": [p.grad.clone() for p in made["experts"]],
                      "in_place": all(p.grad is g and p.grad.data_ptr() == pointer
                                      for p, g, pointer in zip(
                                          [p for kind in made.values() for p in kind], grads,
                                          pointers, strict=True)),
                      "returned": repr(returned)[:80]})
    return found


@functools.cache
def results(layout: str) -> list[list[dict]]:
    return run_on_ranks(sync_run, layout, world_size=LAYOUTS[layout][0])


def members_of(layout: str, rank: int) -> tuple[list[int], list[int]]:
    world, groups, copies = LAYOUTS[layout]
    group = next((g for g in groups or () if rank in g), list(range(world)))
    return group, next((c for c in copies or () if rank in c), [rank])


def name_the_rule(got: torch.Tensor, rules: dict[str, torch.Tensor]) -> str:
    """The rules whose result ``got`` is (several may coincide), as a clause for the message."""
    named = [rule for rule, value in rules.items()
             if got.shape == value.shape and torch.allclose(got, value, rtol=1e-9, atol=1e-12)]
    return "".join(f"{'; or' if i else ':'} that is {rule}" for i, rule in enumerate(named))


@pytest.mark.task11_5
@pytest.mark.parametrize("layout", LAYOUTS)
def test_replicated_gradients_become_the_mean_over_the_group(ex, layout):
    """sync_gradients makes each replicated parameter's gradient the mean over the group: against
    the rule worked out from every rank's seeded gradients, 5 parameter lists on 1, 2 and 4 gloo
    ranks, ep 2, dp 2, dp 2 × ep 2, ep 4, and two groups of 2 side by side."""
    raise_if_untouched(ex.sync_gradients)
    world = LAYOUTS[layout][0]
    for rank, cases in enumerate(results(layout)):
        group, copies = members_of(layout, rank)
        for case, found in enumerate(cases):
            for index, (got, shape) in enumerate(zip(found["replicated"], shapes(case)[0],
                                                     strict=True)):
                every = {r: gradient(case, r, "replicated", index, shape) for r in range(world)}
                total = sum(every[r] for r in group)
                want = total / len(group)
                if torch.allclose(got, want, **TIGHT):
                    continue
                hint = name_the_rule(got, {
                    "the sum over the group, not the mean": total,
                    "the mean over the copies, not the group": (
                        sum(every[r] for r in copies) / len(copies)),
                    "this rank's own gradient, untouched": every[rank],
                    "the mean over every rank, not over group": sum(every.values()) / world,
                    "the sum over the group divided by every rank's count": total / world,
                })
                assert_close(got, want, f"{layout}, case {case}: replicated "
                             f"parameter {index}'s gradient should be the mean over the group "
                             f"{group}{hint}", rank=rank, **TIGHT)


@pytest.mark.task11_5
@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_gradients_become_the_sum_over_copies_divided_by_w(ex, layout):
    """sync_gradients makes each expert's gradient the sum over the ranks that hold its copies
    divided by W, the group's size, not by the copies: against the rule from every rank's seeded
    gradients, in the same 7 layouts; a result that follows another rule is named."""
    raise_if_untouched(ex.sync_gradients)
    world = LAYOUTS[layout][0]
    for rank, cases in enumerate(results(layout)):
        group, copies = members_of(layout, rank)
        for case, found in enumerate(cases):
            for index, (got, shape) in enumerate(zip(found["experts"], shapes(case)[1],
                                                     strict=True)):
                every = {r: gradient(case, r, "experts", index, shape) for r in range(world)}
                total = sum(every[r] for r in copies)
                want = total / len(group)
                if torch.allclose(got, want, **TIGHT):
                    continue
                hint = name_the_rule(got, {
                    "the mean over the copies: divide by W, every rank's loss counts once, and "
                    "each copy saw only its expert-parallel group's tokens": total / len(copies),
                    "the sum over the copies, not divided by W": total,
                    "this rank's own gradient divided by W: the copies were not summed": (
                        every[rank] / len(group)),
                    "this rank's own gradient, untouched": every[rank],
                    "the mean over the whole group: that mixes other ranks' experts into this "
                    "rank's": sum(every[r] for r in group) / len(group),
                    "the sum over the copies divided by every rank, not the group's": (
                        total / world),
                })
                assert_close(got, want, f"{layout}, case {case}: expert parameter "
                             f"{index}'s gradient should be the sum over the copies {copies} "
                             f"divided by W = {len(group)}{hint}", rank=rank, **TIGHT)


@pytest.mark.task11_5
@pytest.mark.parametrize("layout", ["dp 2 x ep 2", "two groups of ep 2"])
def test_gradients_change_in_place(ex, layout):
    """sync_gradients changes every `.grad` in place (the same tensor, the same memory) and returns
    None: dp 2 × ep 2, and two groups of ep 2, on 4 gloo ranks."""
    raise_if_untouched(ex.sync_gradients)
    for rank, cases in enumerate(results(layout)):
        for case, found in enumerate(cases):
            assert found["in_place"], (
                f"{layout}, rank {rank}, case {case}: a parameter's .grad is another tensor, or "
                f"its memory another, after sync_gradients; change each gradient in place "
                f"(all_reduce and div_ do)")
            assert found["returned"] == "None", (
                f"{layout}, rank {rank}: sync_gradients returned {found['returned']}, not None")
