"""Lesson 11 exercises: mixture of experts. The router's top-k choice with a capacity per expert,
the plan that groups a rank's tokens by the rank holding their expert, the all-to-all that
carries them there and their gradients back, the expert-parallel layer built from them, and
which ranks average which gradient when the experts are data parallel too.

Grade with ``pytest lessons/11_mixture_of_experts`` (one task: ``-m task11_1``). Each function's
docstring is its contract: what it takes, what it returns, and what the test checks.

Shapes: a rank routes T tokens among E experts, each token to k of them. An *assignment* is one
(token, choice) pair; ``experts``, ``weights`` and ``kept`` are (T, k), and assignment (t, j) has
the flat index ``t * k + j`` in ``experts.flatten()``. With W ranks, rank r holds experts
``r * E // W`` to ``(r + 1) * E // W - 1``: consecutive blocks of E / W.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


# --8<-- [start:route]
def route(logits: torch.Tensor, k: int, capacity: int | None = None):
    """Top-k routing with a capacity per expert.

    ``logits``: (T, E), the router's scores of every token for every expert. Returns
    ``(experts, weights, kept)``, each (T, k):

    - ``experts[t]``: token t's k experts, the k largest probabilities ``softmax(logits[t])``
      first (largest first);
    - ``weights[t]``: for k >= 2, those k probabilities **renormalised after the top-k**, so that
      a token's k weights sum to 1 (GShard, Mixtral); for k = 1, the probability itself (Switch
      Transformer): renormalised, it would be p / p = 1 and the loss would give the router no
      gradient. Differentiable with respect to ``logits``;
    - ``kept[t, j]`` (bool): whether expert ``experts[t, j]`` takes the assignment. An expert
      takes at most ``capacity`` assignments (``None``: no limit), first come first served in
      this order: every token's first choice, in token order, then every token's second choice,
      and so on. An assignment not kept is dropped: that expert never sees the token.

    ``k`` outside 1..E raises ``ValueError`` naming k and E; so does a negative ``capacity``.

    The test sweeps generated logits, k and capacities against a loop over tokens and experts:
    the experts and their order, the weights and their gradient, and every kept flag; and checks
    that with k = 1 the weights give the router a gradient.
    """
    raise NotImplementedError("task11_1: softmax, top-k, renormalise if k > 1; capacity per expert")
# --8<-- [end:route]


# --8<-- [start:dispatch_plan]
def dispatch_plan(experts: torch.Tensor, kept: torch.Tensor, num_experts: int, world_size: int):
    """Which rows to send, in which order: this rank's kept assignments grouped by expert.

    ``experts`` and ``kept`` are ``route``'s (T, k). Returns ``(order, per_expert)``:

    - ``order``: a 1-D int64 tensor of the flat indices (``t * k + j``) of the kept assignments,
      sorted by expert, and within an expert by flat index. Sending the rows ``order // k`` in
      this order sends to rank 0 first, then rank 1, ..., since experts sit on ranks in blocks;
    - ``per_expert``: (E,) int64, how many kept assignments each expert gets (zeros included).
      ``per_expert.view(W, E // W).sum(1)`` is then what this rank sends to each rank.

    An ``num_experts`` that does not divide by ``world_size`` raises ``ValueError`` naming both.

    The test sweeps generated routings (experts that get nothing, everything dropped) against a
    loop, on the flat indices and the counts.
    """
    raise NotImplementedError("task11_2: kept flat indices, stably by expert; counts per expert")
# --8<-- [end:dispatch_plan]


# --8<-- [start:exchange_counts]
def exchange_counts(per_expert: torch.Tensor, group=None) -> torch.Tensor:
    """Tell every rank how many rows it is about to receive for each of its experts.

    ``per_expert``: (E,) int64, this rank's ``dispatch_plan`` counts; E divides by the group's
    size W. Returns a (W, E // W) int64 tensor whose row s holds, for each expert of this rank,
    how many rows rank s of ``group`` (``None``: every rank) will send it. One all-to-all of the
    counts, nothing else.

    The test checks the result against every rank's counts on 1 to 4 ranks and a subgroup, and
    counts the collectives.
    """
    raise NotImplementedError("task11_3: one all_to_all_single of the counts; view (W, E // W)")
# --8<-- [end:exchange_counts]


# --8<-- [start:AllToAll]
class AllToAll(torch.autograd.Function):
    """Rows to their ranks, with uneven sizes, and their gradients back.

    ``AllToAll.apply(x, send_sizes, receive_sizes, group)``. ``x`` is (N, ...): its first
    ``send_sizes[0]`` rows go to rank 0 of ``group`` (``None``: every rank), the next
    ``send_sizes[1]`` to rank 1, and so on. Returns (sum(receive_sizes), ...): the rows rank 0
    sent this rank, then rank 1's, and so on; ``receive_sizes[s]`` is how many rank s sends it.
    One ``all_to_all_single``. Backward: each row's gradient goes back to the rank it came
    from, to the row it came from: the same exchange with the two lists swapped. Returns
    ``(gradient, None, None, None)``. The sizes may be lists of ints or 1-D integer tensors
    (rows of ``exchange_counts``' result, say). ``x``, and the gradient autograd passes to
    the backward, may be laid out in any order in memory (not contiguous); ``all_to_all_single``
    takes contiguous tensors only.

    ``send_sizes`` that do not add up to N raise ``ValueError`` naming both numbers.

    The test checks outputs and gradients against every rank's rows on 1 to 4 ranks with uneven
    sizes and zeros, a subgroup, and counts one all_to_all each way.
    """

    @staticmethod
    def forward(ctx, x, send_sizes, receive_sizes, group=None):
        raise NotImplementedError("task11_3: check sizes; all_to_all_single with both lists")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("task11_3: the lists swapped; (grad, None, None, None)")
# --8<-- [end:AllToAll]


# --8<-- [start:expert_parallel_forward]
def expert_parallel_forward(tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                            kept: torch.Tensor, local_experts, num_experts: int, group=None):
    """One MoE layer's forward with this rank's block of experts: the tokens travel to their
    experts' ranks and back.

    ``tokens``: (T, C), this rank's. ``experts``, ``weights``, ``kept``: ``route``'s (T, k) for
    them. ``local_experts``: this rank's E / W experts, in order (rank r of ``group`` holds
    experts ``r * E // W`` onwards; ``None``: every rank). Returns (T, C): for each token, the
    sum over its kept assignments of weight × expert(token); a dropped assignment adds 0.

    Use this file's ``dispatch_plan``, ``exchange_counts`` and ``AllToAll``: plan, exchange the
    counts, send the rows (one all-to-all), run each local expert once, on every row that
    arrived for it from any rank (an expert that received no row may be skipped: zero rows
    change nothing), send the results back (a second all-to-all) and put each where its
    assignment was.
    Differentiable: the gradients reach ``tokens``, ``weights`` and the local experts'
    parameters (and only those experts run); every rank, even one that received nothing, takes
    part in the backward's two all-to-alls. A ``local_experts`` of the wrong length raises
    ``ValueError`` naming both numbers.

    The test compares outputs and every gradient with a loop over all ranks' tokens and every
    expert, on 1, 2 and 4 ranks and a subgroup, top-1 and top-2, with drops, an idle expert, a
    rank that receives nothing and capacity 0; it checks that each local expert runs once on
    all its rows (or not at all when none arrived), and counts the all-to-alls and their bytes.
    """
    raise NotImplementedError("task11_4: plan, counts, send, run each expert, send back, weigh")
# --8<-- [end:expert_parallel_forward]


# --8<-- [start:sync_gradients]
def sync_gradients(replicated, experts, copies=None, group=None) -> None:
    """Expert parallel x data parallel: after each rank's backward of the loss of its own batch,
    make every gradient that of the mean of the W ranks' losses (W: the ranks of ``group``;
    None: every rank).

    - ``replicated``: parameters that every rank of ``group`` holds a copy of (attention,
      embeddings, the router). Their gradient becomes the **mean over** ``group``.
    - ``experts``: parameters of this rank's own experts. A rank's expert has already summed
      the gradients of the tokens that every rank of its expert-parallel group sent it.
      ``copies``: a subgroup of ``group``, the ranks that hold a copy of this rank's experts,
      this rank included (one in each expert-parallel group); None: no other rank holds them.
      Their gradient becomes the **sum over** ``copies`` **divided by W**, not by the number of
      copies: each copy has seen only its own expert-parallel group's tokens.

    Each ``.grad`` is changed in place (the optimizer reads it next). Every rank of ``group``
    calls this with its parameters in the same order, each with a gradient, and returns None.

    The test generates every rank's gradients from seeds and compares each rank's result with
    that rule worked out by hand, on 1, 2 and 4 ranks: pure expert parallel (``copies`` None),
    pure data parallel (every rank a copy), 2 x 2, and two groups side by side.
    """
    raise NotImplementedError("task11_5: replicated: mean over group; experts: sum over copies / W")
# --8<-- [end:sync_gradients]
