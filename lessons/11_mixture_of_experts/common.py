"""What the test files of lesson 11 share: the oracles (routing and the dispatch plan worked out
with plain loops, from the rule in the task's text), seeded inputs, and the hardware matrix.

The loops are slow and obvious on purpose: they are written from the contract, not from the
reference answer, and the graders compare a learner's function with them over generated inputs.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from harness.compare import assert_close
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


def loop_experts(tokens, experts, weights, w_in, w_out, weigh="after"):
    """task11_6's layer as a plain loop over the experts: each expert runs on the tokens that
    chose it, its output weighed by the gate weight and added to the token's. ``weigh`` names
    a mistake the graders recognise: "before" the expert (on its input), "not" at all."""
    out = torch.zeros_like(tokens)
    for e in range(w_in.shape[0]):
        for t, j in (experts == e).nonzero().tolist():
            x = tokens[t] * weights[t, j] if weigh == "before" else tokens[t]
            y = torch.nn.functional.gelu(x @ w_in[e]) @ w_out[e]
            out = out.index_add(0, torch.tensor([t]),
                                (y * weights[t, j] if weigh == "after" else y).unsqueeze(0))
    return out


def loop_biased_route(logits, bias, k: int, choose_by="s + b", weigh="s"):
    """task11_7's routing token by token: (experts, weights) as lists, weights differentiable.
    ``choose_by`` and ``weigh`` name mistakes the graders recognise: choosing by "s" alone;
    weighing by "s + b", by a "softmax" of the chosen logits, or by "raw" affinities."""
    experts, weights = [], []
    for row in logits:
        s = [1 / (1 + torch.exp(-x)) for x in row]
        key = [float(s[e].detach()) + (float(bias[e]) if choose_by == "s + b" else 0.0)
               for e in range(len(row))]
        chosen = sorted(range(len(row)), key=lambda e: -key[e])[:k]
        if weigh == "softmax":
            values = [torch.exp(row[e]) for e in chosen]
        else:
            values = [s[e] + (float(bias[e]) if weigh == "s + b" else 0.0) for e in chosen]
        total = sum(values)
        experts.append(chosen)
        weights.append([v if weigh == "raw" else v / total for v in values])
    return experts, weights


def loop_update_bias(bias: list[float], load: list[float], rate: float, rule="sign"):
    """task11_7's bias update, expert by expert, from the paper's words: down by rate when
    overloaded (above the mean load), up when underloaded, unchanged at the mean. ``rule``
    names mistakes the graders recognise: "reversed" signs, "proportional" to the error."""
    mean = sum(load) / len(load)
    new = []
    for b, n in zip(bias, load, strict=True):
        step = (n < mean) - (n > mean)  # +1 underloaded, -1 overloaded, 0 at the mean
        if rule == "reversed":
            step = -step
        if rule == "proportional":
            step = mean - n
        new.append(b + rate * step)
    return new


def assert_routed_as(where: str, experts, weights, want_experts: list[list[int]], want_weights,
                     logits, probe, *, order: str, experts_hint=None, weights_hint=None,
                     graph_hint: str = "") -> None:
    """A router's answer against a loop's: the experts chosen (largest ``order`` first), then the
    weights, then their gradient by the logits along ``probe``. ``experts_hint(got)`` and
    ``weights_hint()`` name a recognised mistake (or return "")."""
    got = experts.tolist()
    if got != want_experts:
        hint = experts_hint(got) if experts_hint else ""
        if not hint and [sorted(row) for row in got] == [sorted(row) for row in want_experts]:
            hint = f": the right experts in the wrong order; largest {order} first"
        raise AssertionError(f"{where}: experts {got}, expected {want_experts}{hint}")
    want = torch.stack([torch.stack(row) for row in want_weights])
    try:
        assert_close(weights, want.detach(), f"{where}: weights", **TIGHT)
    except AssertionError as error:
        raise AssertionError(f"{error}{weights_hint() if weights_hint else ''}") from None
    assert weights.requires_grad, (
        f"{where}: the weights are not differentiable with respect to logits; {graph_hint}")
    (grad,) = torch.autograd.grad((weights * probe).sum(), logits)
    (want_grad,) = torch.autograd.grad((want * probe).sum(), logits)
    assert_close(grad, want_grad, f"{where}: the gradient of sum(weights * c) by logits", **TIGHT)


def names_shape(message: str, shape: tuple[int, ...]) -> bool:
    """Whether ``message`` names ``shape``: its sizes, in order, among the message's numbers, as
    ``(3, 2)``, ``torch.Size([3, 2])`` or ``3 x 2`` print them."""
    numbers = [int(n) for n in re.findall(r"-?\d+", message)]
    return any(tuple(numbers[i:i + len(shape)]) == tuple(shape) for i in range(len(numbers)))
