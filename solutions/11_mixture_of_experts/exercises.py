"""Lesson 11 exercises: mixture of experts. The router's top-k choice with a capacity per expert,
the plan that groups a rank's tokens by the rank holding their expert, the all-to-all that
carries them there and their gradients back, the expert-parallel layer built from them,
which ranks average which gradient when the experts are data parallel too; then dropless
experts as one grouped matrix multiply, and DeepSeek-V3's routing with its balancing bias.

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
    num_tokens, num_experts = logits.shape
    if not 1 <= k <= num_experts:
        raise ValueError(f"k = {k}: choose 1 to {num_experts} of the {num_experts} experts")
    if capacity is not None and capacity < 0:
        raise ValueError(f"capacity = {capacity}: an expert takes 0 or more assignments")
    probs = logits.softmax(dim=-1)
    top, experts = probs.topk(k, dim=-1)
    # k = 1 keeps p itself (Switch): p / p = 1 would leave the router no gradient
    weights = top / top.sum(dim=-1, keepdim=True) if k > 1 else top
    if capacity is None:
        return experts, weights, torch.ones_like(experts, dtype=torch.bool)
    choice_major = experts.t().reshape(-1)  # every first choice, then every second, ...
    onehot = torch.nn.functional.one_hot(choice_major, num_experts)
    place = (onehot.cumsum(dim=0) * onehot).sum(dim=-1) - 1  # its place in its expert's queue
    kept = (place < capacity).reshape(k, num_tokens).t()
    return experts, weights, kept
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
    if num_experts % world_size:
        raise ValueError(f"{num_experts} experts do not split into equal blocks on "
                         f"{world_size} ranks")
    flat_experts = experts.flatten()
    flat_kept = kept.flatten()
    chosen = flat_kept.nonzero().flatten()
    order = chosen[torch.argsort(flat_experts[chosen], stable=True)]
    per_expert = torch.bincount(flat_experts[chosen], minlength=num_experts)
    return order, per_expert
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
    world = dist.get_world_size(group)
    received = torch.empty_like(per_expert)
    dist.all_to_all_single(received, per_expert.contiguous(), group=group)
    return received.view(world, -1)
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
        send_sizes, receive_sizes = [int(n) for n in send_sizes], [int(n) for n in receive_sizes]
        if sum(send_sizes) != x.shape[0]:
            raise ValueError(f"send_sizes add up to {sum(send_sizes)} rows, x has {x.shape[0]}")
        ctx.sizes, ctx.group = (send_sizes, receive_sizes), group
        out = x.new_empty((sum(receive_sizes), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=receive_sizes,
                               input_split_sizes=send_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_sizes, receive_sizes = ctx.sizes
        back = grad.new_empty((sum(send_sizes), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), output_split_sizes=send_sizes,
                               input_split_sizes=receive_sizes, group=ctx.group)
        return back, None, None, None
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
    world = dist.get_world_size(group)
    mine = num_experts // world
    if len(local_experts) != mine or num_experts % world:
        raise ValueError(f"{len(local_experts)} local experts given; {num_experts} experts on "
                         f"{world} ranks are {num_experts / world:g} a rank")
    k = experts.shape[1]
    order, per_expert = dispatch_plan(experts, kept, num_experts, world)
    from_each = exchange_counts(per_expert, group)  # (W, mine): rank s -> each of my experts
    send = per_expert.view(world, mine).sum(dim=1).tolist()
    receive = from_each.sum(dim=1).tolist()
    arrived = AllToAll.apply(tokens[order // k], send, receive, group)  # by source rank
    # Each source's rows are grouped by expert: regroup all of them by my expert, stably.
    local = torch.arange(mine, device=tokens.device).repeat(world)
    by_expert = torch.argsort(local.repeat_interleave(from_each.flatten()), stable=True)
    pieces = arrived[by_expert].split(from_each.sum(dim=0).tolist())
    done = torch.cat([expert(piece) for expert, piece in zip(local_experts, pieces, strict=True)])
    returned = AllToAll.apply(done[torch.argsort(by_expert)], receive, send, group)
    # returned's dtype: the experts' (under autocast, not the tokens'); a dropped slot stays 0
    slots = returned.new_zeros(experts.numel(), returned.shape[-1]).index_copy(0, order, returned)
    return (slots.view(*experts.shape, returned.shape[-1]) * weights.unsqueeze(-1)).sum(dim=1)
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
    world = dist.get_world_size(group)
    for parameter in replicated:
        dist.all_reduce(parameter.grad, group=group)
        parameter.grad.div_(world)
    for parameter in experts:
        if copies is not None:
            dist.all_reduce(parameter.grad, group=copies)
        parameter.grad.div_(world)
# --8<-- [end:sync_gradients]


# --8<-- [start:grouped_matmul]
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_said_fallback = []  # the reasons already printed: each is said once per process


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Given, not a task: ``x`` (N, a) holds the groups' rows one after another, ``w`` (G, a, b)
    one matrix per group, ``offs`` (G,) int32 where each group's rows end (``offs[-1] = N``).
    Returns (N, b): group g's rows times ``w[g]``.

    ``torch.nn.functional.grouped_mm`` does it in one call where this torch has it (2.11 does)
    and takes these tensors: float32, bfloat16 or float16, each row a multiple of 16 bytes.
    Otherwise (older torch, float64, rows of other widths) a loop over the groups gives the same
    result, and says why once.
    """
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None)
    row_bytes = {x.shape[1] * x.element_size(), w.shape[2] * w.element_size()}
    if grouped_mm is None:
        reason = f"torch {torch.__version__} has no torch.nn.functional.grouped_mm"
    elif x.dtype not in GROUPED_MM_DTYPES or w.dtype != x.dtype:
        reason = f"grouped_mm takes float32, bfloat16 or float16, not {x.dtype}"
    elif any(size % 16 for size in row_bytes):
        reason = f"grouped_mm wants rows of a multiple of 16 bytes, not {sorted(row_bytes)}"
    else:
        return grouped_mm(x, w, offs=offs)
    if reason not in _said_fallback:
        _said_fallback.append(reason)
        print(f"grouped_matmul: {reason}; looping over the groups instead")
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    out = [x[start:end] @ w[g] for g, (start, end) in enumerate(zip(starts, ends, strict=True))]
    return torch.cat(out) if out else x.new_zeros(0, w.shape[2])
# --8<-- [end:grouped_matmul]


# --8<-- [start:grouped_experts]
def grouped_experts(tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                    w_in: torch.Tensor, w_out: torch.Tensor, align: int = 8) -> torch.Tensor:
    """Dropless experts: every assignment runs, each expert's rows as one group of a grouped
    matrix multiply.

    ``tokens``: (T, d). ``experts``, ``weights``: (T, k), each token's k expert ids (0..E-1)
    and gate weights. ``w_in``: (E, d, h) and ``w_out``: (E, h, d), the E experts' stacked
    weights: expert e maps a row x to ``gelu(x @ w_in[e]) @ w_out[e]`` (the running example's
    MLP, without biases). Returns (T, d): for each token, the sum over its k assignments of
    weight × expert(token). No capacity: nothing is dropped.

    1. Sort the T * k assignments by expert id (flat index ``t * k + j``, as in task11_2), so
       that each expert's rows are contiguous.
    2. Lay them out in one zero-filled buffer where each expert's group is padded with zero rows
       to a multiple of ``align`` rows (an expert with no rows: 0 rows), which is what grouped
       kernels want.
    3. Run the experts as ``grouped_matmul`` (above) twice, once with ``w_in`` and once with
       ``w_out``, with ``offs`` the int32 ends of the padded groups, the gelu between them.
    4. Drop the padding rows, put each row back at its assignment (the inverse of the sort),
       weigh it by its gate weight and sum over the k choices.

    Differentiable with respect to ``tokens``, ``weights``, ``w_in`` and ``w_out``. An
    ``align`` below 1, an expert id outside 0..E-1, or ``weights`` not shaped like ``experts``
    raises ``ValueError`` naming the number.

    The test sweeps generated routings (uneven loads, an expert with no rows, k = 1 and 2,
    align 1, 3 and 8) against a plain loop over the experts: the output and the gradients of
    tokens, weights, w_in and w_out; and it watches grouped_matmul's two calls and their
    offsets.
    """
    num_experts, k = w_in.shape[0], experts.shape[1]
    if align < 1:
        raise ValueError(f"align = {align}: pad each group to a multiple of 1 or more rows")
    if weights.shape != experts.shape:
        raise ValueError(f"weights are {tuple(weights.shape)}, experts {tuple(experts.shape)}: "
                         f"one gate weight per assignment")
    if experts.numel() and not 0 <= int(experts.min()) <= int(experts.max()) < num_experts:
        bad = int(experts.max()) if int(experts.max()) >= num_experts else int(experts.min())
        raise ValueError(f"expert id {bad}: the ids run from 0 to {num_experts - 1}")
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # sorted place -> flat assignment t * k + j
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + align - 1) // align * align  # each group's rows, padding included
    first = torch.cumsum(padded, dim=0) - padded  # where each group starts in the buffer
    before = torch.cumsum(counts, dim=0) - counts  # where it starts without padding
    sorted_experts = flat[order]
    rows = first[sorted_experts] + torch.arange(flat.numel(), device=flat.device) \
        - before[sorted_experts]  # the buffer row of each sorted assignment
    x = tokens.new_zeros(int(padded.sum()), tokens.shape[1])
    x = x.index_copy(0, rows, tokens[order // k])
    offs = torch.cumsum(padded, dim=0).to(torch.int32)
    hidden = torch.nn.functional.gelu(grouped_matmul(x, w_in, offs))
    done = grouped_matmul(hidden, w_out, offs)[rows]  # the padding dropped, in sorted order
    # back to flat order: the row at sorted place p belongs to assignment order[p]
    per_assignment = done.new_zeros(done.shape).index_copy(0, order, done)
    return (per_assignment.view(*experts.shape, -1) * weights.unsqueeze(-1)).sum(dim=1)
# --8<-- [end:grouped_experts]


# --8<-- [start:biased_route]
def biased_route(logits: torch.Tensor, bias: torch.Tensor, k: int):
    """DeepSeek-V3's routing: sigmoid affinities, a per-expert bias that steers only the choice.

    ``logits``: (T, E), the router's scores (the logits as given: ``u_t @ e_i``). ``bias``:
    (E,), one number per expert. Returns ``(experts, weights)``, each (T, k):

    - the affinities are ``s = sigmoid(logits)``;
    - ``experts[t]``: the k experts with the largest ``s[t] + bias``, largest first (equal
      values may come in any order; the test draws none);
    - ``weights[t, j]``: the chosen experts' affinities ``s`` normalised among the chosen,
      ``s[t, e_j] / sum over j' of s[t, e_j']``; the bias does not enter them. Differentiable
      with respect to ``logits``.

    ``k`` outside 1..E, or a ``bias`` that is not (E,), raises ``ValueError`` naming the
    numbers.

    The test sweeps generated logits, biases and k against a loop over tokens and experts: the
    experts and their order, the weights and their gradient by the logits.
    """
    num_experts = logits.shape[1]
    if not 1 <= k <= num_experts:
        raise ValueError(f"k = {k}: choose 1 to {num_experts} of the {num_experts} experts")
    if bias.shape != (num_experts,):
        raise ValueError(f"bias is {tuple(bias.shape)}: one number for each of the "
                         f"{num_experts} experts, ({num_experts},)")
    scores = logits.sigmoid()
    experts = (scores.detach() + bias).topk(k, dim=-1).indices  # the bias only chooses
    chosen = scores.gather(-1, experts)
    return experts, chosen / chosen.sum(dim=-1, keepdim=True)
# --8<-- [end:biased_route]


# --8<-- [start:update_bias]
def update_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free balance, after a step: a new (E,) bias.

    ``load``: (E,), how many assignments each expert received in the step (the whole batch).
    An expert is overloaded when its load is above the mean load over the E experts, and
    underloaded when below. Its bias **decreases by** ``rate`` when overloaded, **increases
    by** ``rate`` when underloaded, and stays when its load equals the mean: the step is the
    sign of the error, never its size. Returns a new tensor, ``bias``' dtype; ``bias`` is left
    as it was.

    A negative ``rate``, or a ``load`` not shaped like ``bias``, raises ``ValueError`` naming
    it.

    The test sweeps generated biases, loads (ties with the mean among them) and rates against
    that rule, elementwise.
    """
    if rate < 0:
        raise ValueError(f"rate = {rate}: the bias update speed is 0 or more")
    if load.shape != bias.shape:
        raise ValueError(f"load is {tuple(load.shape)}, bias {tuple(bias.shape)}: one load "
                         f"per expert")
    load = load.to(torch.float64)
    return bias + rate * torch.sign(load.mean() - load).to(bias.dtype)
# --8<-- [end:update_bias]
