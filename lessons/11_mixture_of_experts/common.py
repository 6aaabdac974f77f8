"""What the test files of lesson 11 share: the oracles (routing and the dispatch plan worked out
with plain loops, from the rule in the task's text), seeded inputs, and the hardware matrix.

The loops are slow and obvious on purpose: they are written from the contract, not from the
reference answer, and the graders compare a learner's function with them over generated inputs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.ranks import group_params

LESSON = "11_mixture_of_experts"
SCRIPT = f"lessons/{LESSON}/moe.py"
# all_to_all_single: gloo with CPU tensors (1 to 4 ranks) and nccl with one rank per GPU, what
# runs all-to-alls on GPUs.
GROUPS = group_params(world_sizes=(1, 2, 3, 4), cuda_world_sizes=())
TIGHT = {"rtol": 1e-9, "atol": 1e-9}  # float64 throughout


def seeded(seed: int, *shape: int, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def seeded_counts(seed: int, *shape: int, high: int = 4) -> torch.Tensor:
    """int64 counts in [0, high), zeros among them."""
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def loop_route(logits: torch.Tensor, k: int, capacity: int | None):
    """(experts, weights, kept) as lists of lists, token by token; weights differentiable:
    renormalised over the k chosen for k > 1, each probability itself for k = 1 (Switch)."""
    experts, weights = [], []
    for row in logits:
        probs = torch.exp(row - torch.logsumexp(row, dim=0))
        ranked = sorted(range(len(row)), key=lambda e: -float(probs[e].detach()))[:k]
        total = sum(probs[e] for e in ranked)
        experts.append(ranked)
        weights.append([probs[e] / total if k > 1 else probs[e] for e in ranked])
    taken = [0] * logits.shape[1]
    kept = [[False] * k for _ in experts]
    for choice in range(k):  # every token's first choice, then every second choice, ...
        for token, chosen in enumerate(experts):
            e = chosen[choice]
            if capacity is None or taken[e] < capacity:
                taken[e] += 1
                kept[token][choice] = True
    return experts, weights, kept


def loop_plan(experts: list[list[int]], kept: list[list[bool]], num_experts: int):
    """(order, per_expert) as lists: flat indices t * k + j of kept assignments, expert by
    expert, each expert's in increasing flat index."""
    k = len(experts[0]) if experts else 0
    order = [t * k + j for e in range(num_experts) for t, row in enumerate(experts)
             for j in range(k) if row[j] == e and kept[t][j]]
    per_expert = [sum(1 for t, row in enumerate(experts) for j in range(k)
                      if row[j] == e and kept[t][j]) for e in range(num_experts)]
    return order, per_expert


def my_group(ctx, groups):
    """Build every subgroup in ``groups`` (each rank must, in the same order); return this
    rank's group (``None`` without subgroups) and its members."""
    group, members = None, list(range(ctx.world_size))
    for ranks in groups or ():
        made = dist.new_group(ranks)
        if ctx.rank in ranks:
            group, members = made, ranks
    return group, members


def everyone_agrees(ctx, ok: bool) -> bool:
    """Whether every rank's ``ok`` holds (one all-reduce over all ranks, which the graders do
    not count): a rank may go on to a backward's collectives only when every rank does."""
    flag = torch.tensor([int(ok)], device=ctx.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
