"""Lesson 10 exercises: long sequences. Sequence parallel's two collectives, then attention over a
sequence split across ranks: the online-softmax merge, one ring step, the zig-zag split, the ring.

Grade with ``pytest lessons/10_long_sequences`` (one task: ``-m task10_1``). Each function's
docstring is its contract: what it takes, what it returns, and what the test checks.

Shapes are those of ``F.scaled_dot_product_attention``: queries, keys and values are
(batch, heads, tokens, head_dim), and a log-sum-exp ``lse`` is (batch, heads, tokens), in natural
log. A token's *position* is its place in the whole sequence, 0 to S-1; ``positions`` tensors are
1-D integer tensors with one entry per token a rank holds. Under causal masking the query at
position p sees the keys at positions <= p, wherever they are held.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (the old names now warn);
# torch 2.11 and 2.12 have only the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# --8<-- [start:AllGatherSequence]
class AllGatherSequence(torch.autograd.Function):
    """Where tokens split along the sequence enter a tensor-parallel region (lesson 06's *f*,
    under sequence parallelism).

    ``AllGatherSequence.apply(x, group, dim)``. ``x`` holds this rank's tokens, consecutive along
    ``dim``, the same shape on every rank of ``group`` (``None``: every rank). Forward: the
    whole sequence on every rank, every rank's ``x`` concatenated along ``dim`` in the group's
    rank order: one all-gather. Backward: each rank's split layers used every token, so the
    gradient of this rank's tokens is the **sum over the group's ranks** of their gradients
    for those tokens: this rank's piece of a reduce-scatter. Returns ``(gradient, None, None)``.

    The test checks the output and the gradient against one process for world sizes 1 to 4,
    several ``dim`` and a subgroup, and counts one all_gather in forward and one reduce_scatter
    in backward and nothing else (an all-reduce and a slice give the same numbers but send twice
    the bytes, and keep the whole sum on every rank).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
        raise NotImplementedError("task10_1: all-gather x along dim in rank order; keep group, dim")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise NotImplementedError("task10_1: reduce-scatter grad along dim; (grad, None, None)")
# --8<-- [end:AllGatherSequence]


# --8<-- [start:ReduceScatterSequence]
class ReduceScatterSequence(torch.autograd.Function):
    """Where a tensor-parallel region's partial sums leave for tokens split along the sequence
    (lesson 06's *g*, under sequence parallelism).

    ``ReduceScatterSequence.apply(x, group, dim)``. ``x`` is this rank's partial sum for the
    whole sequence, the same shape on every rank. Forward: cut the sum over the group's ranks
    into W equal pieces along ``dim`` and return piece r to rank r: one reduce-scatter. A size
    along ``dim`` that does not divide by W raises a ``ValueError`` naming both numbers.
    Backward: each rank has the gradient of its own tokens; the gradient of the whole ``x`` is
    every rank's, concatenated along ``dim`` in rank order: one all-gather. Returns
    ``(gradient, None, None)``. ``x`` itself is left unchanged.

    The test checks output and gradient against one process for world sizes 1 to 4, several
    ``dim`` and a subgroup, the error, and counts one reduce_scatter in forward and one
    all_gather in backward and nothing else.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
        raise NotImplementedError("task10_1: check the size divides; reduce-scatter x along dim")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise NotImplementedError("task10_1: all-gather the gradient along dim; (grad, None, None)")
# --8<-- [end:ReduceScatterSequence]


# --8<-- [start:merge_partials]
def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries, over two disjoint sets of keys, merged into
    the attention over both: the online-softmax (log-sum-exp) rule.

    ``out_a`` (..., T, D) is softmax(scores over set a) @ (values of a), row by row, and
    ``lse_a`` (..., T) the log-sum-exp of those scores; the same for b. A row that saw no key
    of a set has lse -inf there, and a zero out row (on one side at most). Returns
    ``(out, lse)``: ``lse = log(exp(lse_a) + exp(lse_b))`` and
    ``out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b``, row by row: exactly what
    attention over the union of the keys gives. Computed without overflow or underflow (lse may
    be in the hundreds, and differ from row to row: subtract each row's larger lse before
    exponentiating), with no NaN where one side is -inf, and differentiable by autograd (torch
    operations only).

    The test checks it against ``F.scaled_dot_product_attention`` over the union of the keys,
    on generated shapes, splits and score scales, with the gradients of every input, in float32
    with rows whose lse are far apart, and with rows that one side did not see.
    """
    raise NotImplementedError("task10_2: the log-sum-exp rule, stably: subtract the larger lse")
# --8<-- [end:merge_partials]


# --8<-- [start:attend_block]
def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 q_positions: torch.Tensor, k_positions: torch.Tensor, causal: bool = True,
                 scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of ring attention: this rank's queries against one block of keys and values,
    which may have come from any rank.

    ``q`` (B, H, Tq, D), ``k`` and ``v`` (B, H, Tk, D); ``q_positions`` (Tq,) and
    ``k_positions`` (Tk,) are the tokens' positions in the whole sequence. ``scale``: ``None``
    means ``1 / sqrt(D)``, as in ``F.scaled_dot_product_attention``; any number given is used,
    0.0 included. The scores are
    ``q @ k.T * scale``; with ``causal``, the query at position p sees only the keys at
    positions <= p, **global** positions (a block's first key is not position 0), and the
    other scores are -inf. Returns ``(out, lse)``: ``out`` (B, H, Tq, D) the softmax of each
    row of scores times ``v``, ``lse`` (B, H, Tq) each row's log-sum-exp, computed without
    overflow for scores in the hundreds. A row that sees no key of the block gets an out row of
    zeros and lse -inf, and no NaN appears in the outputs or in any gradient (autograd, torch
    operations only).

    The test checks it against ``F.scaled_dot_product_attention`` with the same mask and
    against the log-sum-exp of the scores, on generated sizes and positions, causal and not,
    with and without ``scale`` (0.0 too), gradients included, with rows that see nothing, and in
    float32
    with scores in the hundreds.
    """
    raise NotImplementedError("task10_3: mask by global positions; (softmax @ v, lse), no NaN")
# --8<-- [end:attend_block]


# --8<-- [start:zigzag_split]
def zigzag_split(x: torch.Tensor, world_size: int, dim: int) -> list[torch.Tensor]:
    """Split a sequence among ``world_size`` ranks so that causal attention costs each the same.

    Cut ``x`` along ``dim`` into 2W equal chunks, numbered 0 to 2W-1 in the sequence's order,
    and give rank r chunks r and 2W-1-r, concatenated in that order (a chunk from the start and
    its mirror from the end). Returns the W pieces in rank order. A length along ``dim`` that
    does not divide by 2W raises a ``ValueError`` that names both numbers: padding the sequence
    is the caller's choice. (PyTorch's context parallel splits the same way: its head-tail load
    balancer.)

    The test checks the pieces against torch's load balancer where your torch has it, and
    against the rule above, on generated sizes, world sizes and dims, and that every rank then
    sees the same number of (query, key) pairs under a causal mask.
    """
    raise NotImplementedError("task10_4: 2W chunks; rank r gets chunks r and 2W-1-r")
# --8<-- [end:zigzag_split]


# --8<-- [start:zigzag_merge]
def zigzag_merge(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The inverse of ``zigzag_split``: its W pieces, in rank order, put back into the
    sequence's order along ``dim``. ``zigzag_merge(zigzag_split(x, W, dim), dim)`` equals ``x``.

    The test checks that on generated sizes, world sizes and dims, and on pieces that are not a
    split of anything (the rule alone decides).
    """
    raise NotImplementedError("task10_4: first halves in rank order, then second halves reversed")
# --8<-- [end:zigzag_merge]


def ring_pass(tensors: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """Send each tensor to the next rank of the ring (rank + 1, mod W) and receive the previous
    rank's, of the same shape and dtype, in its place; returns what was received.

    One batch of isend/irecv: every rank posts its send and its receive together, so no rank
    waits for its neighbour to post a receive first (a ring of blocking sends can deadlock).
    A lost neighbour ends the wait after the group's timeout.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return list(tensors)
    group = group or dist.group.WORLD
    to = dist.get_global_rank(group, (rank + 1) % world)
    source = dist.get_global_rank(group, (rank - 1) % world)
    # contiguous: a transposed tensor's strides would make a receive buffer torch refuses
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = []
    for tensor, into in zip(tensors, received, strict=True):
        ops.append(dist.P2POp(dist.isend, tensor.contiguous(), to, group))
        ops.append(dist.P2POp(dist.irecv, into, source, group))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


# --8<-- [start:ring_attention]
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   group=None, causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's queries over the whole sequence, whose keys and values are split
    across the group's ranks, computed one block of keys and values at a time.

    ``q``, ``k``, ``v`` (B, H, T, D) are this rank's tokens, at ``positions`` (T,) in the whole
    sequence (any split: contiguous blocks, zig-zag; T is the same on every rank). Start with
    this rank's own block; then, W - 1 times, hand the block you hold (keys, values and their
    positions) to the next rank with ``ring_pass`` and take the previous rank's. Attend to each
    block with ``attend_block`` and fold the results together with ``merge_partials``. Under
    ``causal``, a block none of whose keys any of this rank's queries may see is skipped: no
    scores are computed for it (it is still passed on). Returns ``(out, lse)`` for this rank's
    queries: what attention over the whole sequence gives them (for out,
    ``F.scaled_dot_product_attention`` with ``is_causal``).

    Autograd carries the gradient to ``q`` (and to this rank's own k and v) but not across
    ``ring_pass`` to the keys and values other ranks hold, and it keeps every block's
    probabilities for the backward: the lesson's ``ring_attention.py`` adds a backward by hand
    that needs neither.

    The test runs 1 to 4 ranks with contiguous and zig-zag splits, causal and not, and
    compares out, lse, the gradient of q and that of this rank's own k and v with
    ``F.scaled_dot_product_attention`` over the whole sequence; it checks that every rank
    calls ``ring_pass`` W - 1 times (a rank that makes fewer leaves its neighbours waiting: the
    ring hangs), that no matrix product is larger than one block of scores (T x T per head),
    that no tensor is larger than that or than one block's keys and values together (k and v
    stacked for one ``ring_pass`` are fine, the whole sequence's keys are not), and that a
    skipped block costs no scores.
    """
    raise NotImplementedError("task10_5: own block, then W-1 ring_pass steps; attend, merge")
# --8<-- [end:ring_attention]


# --8<-- [start:SeqAllToAll]
class SeqAllToAll(torch.autograd.Function):
    """DeepSpeed-Ulysses' exchange: one dimension split across the group's ranks becomes
    another.

    ``SeqAllToAll.apply(x, scatter_dim, gather_dim, group)``. Every rank of ``group`` (``None``:
    every rank) calls it with the same shapes. Cut ``x`` along ``scatter_dim`` into W equal
    pieces (W the group's size) and send piece j to rank j; put the W pieces received,
    rank 0's first, side by side along ``gather_dim``: one ``all_to_all_single``. So rank j
    returns piece j of every rank's ``x``: ``scatter_dim`` W times shorter, ``gather_dim`` W
    times longer. For (batch, heads, tokens, head_dim) and dims (1, 2): each rank's tokens
    for every head become every token for this rank's block of heads. A ``scatter_dim`` whose
    size does not divide by W raises ``ValueError`` naming both numbers.
    Backward: the same exchange the other way, ``gather_dim`` cut and ``scatter_dim`` joined,
    so that each piece's gradient goes home. Returns ``(gradient, None, None, None)``.

    The test checks output and gradient against every rank's pieces on 2 and 4 ranks, for the
    heads-to-sequence exchange and back, and counts one all_to_all each way.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, scatter_dim: int, gather_dim: int, group=None):
        raise NotImplementedError("task10_6: W pieces along scatter_dim out, joined along "
                                  "gather_dim")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise NotImplementedError("task10_6: the reverse exchange; (grad, None, None, None)")
# --8<-- [end:SeqAllToAll]


# --8<-- [start:ulysses_attention]
def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None,
                      causal: bool = True) -> torch.Tensor:
    """Attention over a sequence split across the group's ranks, DeepSpeed-Ulysses' way: swap
    the split from tokens to heads, attend whole sequences, swap back.

    ``q``, ``k``, ``v`` (B, H, L, D), the same shape on every rank: rank r's L consecutive
    tokens, positions r·L to (r+1)·L - 1 of a sequence of W·L, for all H heads. With
    ``SeqAllToAll``, turn each into (B, H/W, W·L, D): the whole sequence for this rank's H/W
    heads; attend (``F.scaled_dot_product_attention``, causal if ``causal``); turn the output
    back into (B, H, L, D) with the exchange the other way. Returns that output: for this rank's
    tokens, what attention over the whole sequence gives them, every head. H not divisible
    by W raises a ``ValueError`` that says so (the heads, H and W), before any exchange.

    Each of q, k and v crosses the network once (one all-to-all each, or one for the three
    stacked), and the output once; the backward sends each gradient back the same way.
    Autograd carries the gradients to q, k and v: all of this rank's, since the exchanges
    are differentiable.

    The test compares the output and the gradients of q, k and v with
    ``F.scaled_dot_product_attention`` over the whole sequence in one process, on 2 and 4 ranks,
    causal and not, over generated sizes, and in a subgroup; it counts the bytes every
    all-to-all moves, forward and backward (the four tensors' size, nothing else), and checks
    the error.
    """
    raise NotImplementedError("task10_6: q, k, v to (B, H/W, S, D); SDPA; back to (B, H, L, D)")
# --8<-- [end:ulysses_attention]


# --8<-- [start:token_mean_loss]
def token_mean_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                    group=None) -> torch.Tensor:
    """The cross-entropy averaged over every real token of every rank of ``group``, when the
    batch, or each sequence, is split across the ranks.

    ``logits`` (..., V) and ``targets`` (...) are this rank's tokens, any number of them; a
    target equal to ``ignore_index`` (padding, a prompt) is not a real token. Returns a
    scalar, the same on every rank: the sum of the cross-entropy over every rank's real tokens
    divided by how many there are, N: what ``F.cross_entropy(..., ignore_index=...)`` gives on
    every rank's tokens together. A rank with no real token is fine (no NaN); when no rank
    has one, the loss is 0 and so are its gradients.

    Its gradient is this rank's share: the gradient of this rank's own real tokens' sum
    divided by N. So the gradients, **summed** over the ranks, are the gradient of the whole
    batch's mean in one process. Under ``DistributedDataParallel``, which **averages** them
    over its W ranks, call ``(W * loss).backward()``.

    The test compares the value and the gradients (of the logits, and of a weight every rank
    shares, summed over the ranks) with ``F.cross_entropy`` on the whole batch in one process,
    on 2 and 3 ranks with generated uneven counts of real tokens (zero on some ranks), with
    ``ignore_index`` -100 and 0, under DDP with ``W * loss``, and in a subgroup.
    """
    raise NotImplementedError("task10_7: sum over real tokens; all-reduce sum and count; divide")
# --8<-- [end:token_mean_loss]
