"""Lesson 11, task11_2: dispatch_plan, this rank's kept assignments grouped by expert, swept
against a loop over experts and assignments: the flat indices in their order and the count per
expert, over routings where some expert gets nothing and where everything is dropped.

    pytest lessons/11_mixture_of_experts -m task11_2
"""

from __future__ import annotations

import pytest
import torch

from harness.sweep import st, sweep
from lesson11.common import loop_plan

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task11_2": {
        "order: the flat indices t * k + j of the kept assignments only":
            ["test_plan_matches_a_loop"],
        "order: sorted by expert, within an expert by flat index": ["test_plan_matches_a_loop"],
        "per_expert: (E,) int64 counts of kept assignments, zeros included":
            ["test_plan_matches_a_loop"],
        "E that does not divide by W raises ValueError naming both":
            ["test_plan_refuses_experts_that_do_not_split"],
    },
}


def routing(generator: torch.Generator, tokens: int, k: int, num_experts: int, keep: float,
            skip_last: bool):
    """Each token's k distinct experts (never the last one when ``skip_last`` and k < E), and
    a kept flag for each, True with probability ``keep``."""
    choose_from = num_experts - 1 if skip_last and k < num_experts else num_experts
    experts = torch.stack([torch.randperm(choose_from, generator=generator)[:k]
                           for _ in range(tokens)]) if tokens else torch.zeros(0, k).long()
    kept = torch.rand(tokens, k, generator=generator) < keep
    return experts, kept


@pytest.mark.task11_2
@sweep(tokens=st.integers(0, 10), per_rank=st.integers(1, 3), world=st.integers(1, 4),
       keep=st.sampled_from([0.0, 0.5, 0.8, 1.0]), data=st.data(), seed=st.integers(0, 2**16))
def test_plan_matches_a_loop(ex, tokens, per_rank, world, keep, data, seed):
    """dispatch_plan equals a loop over experts and assignments, on 25 generated routings (0 to 10
    tokens, 1 to 4 ranks of 1 to 3 experts, none to all assignments kept, some experts chosen by
    nobody): the kept flat indices sorted by expert, then by index, and each expert's count, int64.
    """
    num_experts = per_rank * world
    k = data.draw(st.integers(1, num_experts), label="k")
    generator = torch.Generator().manual_seed(seed)
    experts, kept = routing(generator, tokens, k, num_experts, keep, skip_last=seed % 3 == 0)
    where = (f"dispatch_plan(experts {experts.tolist()}, kept {kept.tolist()}, "
             f"num_experts={num_experts}, world_size={world})")
    order, per_expert = ex.dispatch_plan(experts, kept, num_experts, world)
    want_order, want_counts = loop_plan(experts.tolist(), kept.tolist(), num_experts)
    assert per_expert.dtype == torch.int64 and order.dtype == torch.int64, (
        f"{where}: order is {order.dtype} and per_expert {per_expert.dtype}; both int64")
    if per_expert.tolist() != want_counts:
        every = torch.bincount(experts.flatten(), minlength=num_experts).tolist()
        hint = (": that counts the dropped assignments too; count the kept ones, what each "
                "expert will receive" if per_expert.tolist() == every and every != want_counts
                else "")
        raise AssertionError(f"{where}: per_expert {per_expert.tolist()}, expected "
                             f"{want_counts}{hint}")
    got = order.tolist()
    if got != want_order:
        hint = ""
        if sorted(got) == sorted(want_order):
            hint = (": the right assignments in the wrong order; sort them by expert, and "
                    "within an expert by flat index (a stable sort of the kept ones)")
        elif set(want_order) < set(got):
            hint = ": that sends dropped assignments too; send only the kept ones"
        raise AssertionError(f"{where}: order {got}, expected {want_order}{hint}")


@pytest.mark.task11_2
@pytest.mark.parametrize("num_experts, world", [(3, 2), (4, 3), (2, 4)])
def test_plan_refuses_experts_that_do_not_split(ex, num_experts, world):
    """dispatch_plan raises a ValueError naming both numbers for 3 experts on 2 ranks, 4 on 3 and 2
    on 4."""
    experts = torch.zeros(2, 1, dtype=torch.int64)
    kept = torch.ones(2, 1, dtype=torch.bool)
    with pytest.raises(ValueError) as raised:
        ex.dispatch_plan(experts, kept, num_experts, world)
    message = str(raised.value)
    assert str(num_experts) in message and str(world) in message, (
        f"dispatch_plan with {num_experts} experts on {world} ranks: the message should name "
        f"both numbers: {message}")
