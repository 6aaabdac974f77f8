"""Lesson 10, task10_6: DeepSpeed-Ulysses. SeqAllToAll, the exchange that turns a split of the
tokens into a split of the heads (and back, in the backward), and ulysses_attention, which
attends whole sequences between two of them: against attention over the whole sequence in one
process, on 2 and 4 gloo ranks, with the bytes of every all-to-all counted.

    pytest lessons/10_long_sequences -m task10_6
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from harness.collectives import CollectiveLog
from harness.compare import assert_close
from harness.exercises import load_exercise, raise_if_untouched
from harness.ranks import run_on_ranks
from harness.sweep import st, sweep
from lesson10.common import LESSON, TIGHT, as_one_failure, seeded

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task10_6": {
        "SeqAllToAll forward: piece j along scatter_dim to rank j, joined along gather_dim in "
        "rank order": ["test_seq_all_to_all_sends_piece_j_to_rank_j"],
        "SeqAllToAll: one all_to_all each way": ["test_seq_all_to_all_sends_piece_j_to_rank_j"],
        "SeqAllToAll backward: the reverse exchange, (gradient, None, None, None)":
            ["test_seq_all_to_all_sends_piece_j_to_rank_j"],
        "SeqAllToAll: a size that does not divide raises ValueError naming both":
            ["test_seq_all_to_all_refuses_a_size_that_does_not_divide"],
        "ulysses_attention: out is attention over the whole sequence for this rank's tokens":
            ["test_ulysses_attention_equals_attention_over_the_whole_sequence"],
        "ulysses_attention: out is (B, H, L, D), tokens split again":
            ["test_ulysses_attention_equals_attention_over_the_whole_sequence"],
        "ulysses_attention: the gradients of q, k and v": [
            "test_ulysses_attention_equals_attention_over_the_whole_sequence"],
        "ulysses_attention: causal and not, causal by default": [
            "test_ulysses_attention_equals_attention_over_the_whole_sequence"],
        "ulysses_attention: q, k, v and out cross once each, forward and backward":
            ["test_ulysses_attention_sends_each_tensor_once"],
        "ulysses_attention: heads not divisible by W raise ValueError":
            ["test_ulysses_attention_refuses_heads_that_do_not_divide"],
        "within group only": ["test_ulysses_attention_stays_within_its_group"],
    },
}


def make_group(ctx, groups):
    """Every rank builds every subgroup; returns this rank's group (None: the world), its
    members and its place among them."""
    group, members = None, list(range(ctx.world_size))
    for ranks in groups or ():
        made = dist.new_group(ranks)
        if ctx.rank in ranks:
            group, members = made, ranks
    return group, members, members.index(ctx.rank)


def calls_of(log: CollectiveLog) -> list[tuple[str, int]]:
    return [(call.op, call.payload) for call in log.calls]


# -- SeqAllToAll ---------------------------------------------------------------------------------


def exchange_shape(scatter_dim: int, world: int) -> list[int]:
    shape = [2, 3, 5, 2]
    shape[scatter_dim] = 2 * world
    return shape


def exchange_run(ctx, scatter_dim: int, gather_dim: int):
    """SeqAllToAll on this rank's x, then the backward of (y * c).sum(); both counted."""
    ex = load_exercise(LESSON)
    x = seeded(100 + ctx.rank, *exchange_shape(scatter_dim, ctx.world_size)).requires_grad_(True)
    with CollectiveLog(ex) as forward:
        y = ex.SeqAllToAll.apply(x, scatter_dim, gather_dim, None)
    found = {"y": y.detach(), "forward": calls_of(forward), "backward": []}
    with CollectiveLog(ex) as backward:
        try:
            (y * seeded(200 + ctx.rank, *y.shape)).sum().backward()
        except (RuntimeError, ValueError) as error:  # a gradient of the wrong shape, say
            return {**found, "grad": None, "backward_error": str(error)[:300]}
    return {**found, "grad": x.grad, "backward": calls_of(backward)}


@pytest.mark.task10_6
@pytest.mark.parametrize("dims", [(1, 2), (2, 1), (0, -1)], ids=["heads-to-tokens",
                                                                  "tokens-to-heads", "0-to--1"])
@pytest.mark.parametrize("world", [2, 4])
def test_seq_all_to_all_sends_piece_j_to_rank_j(ex, world, dims):
    """SeqAllToAll returns on rank j piece j (along scatter_dim) of every rank's x, joined along
    gather_dim in rank order, and sends each gradient piece home in the backward, one all_to_all
    each way: on 2 and 4 gloo ranks, dims (1, 2), (2, 1) and (0, -1), against every rank's x."""
    raise_if_untouched(ex.SeqAllToAll.forward, ex.SeqAllToAll.backward)
    scatter_dim, gather_dim = dims
    results = run_on_ranks(exchange_run, scatter_dim, gather_dim, world_size=world)
    xs = [seeded(100 + r, *exchange_shape(scatter_dim, world)) for r in range(world)]
    nbytes = 8 * xs[0].numel()
    what = f"SeqAllToAll.apply(x, {scatter_dim}, {gather_dim}) on {world} ranks"
    for rank, got in enumerate(results):
        expected = torch.cat([x.chunk(world, scatter_dim)[rank] for x in xs], dim=gather_dim)
        why = ""
        reversed_order = torch.cat([x.chunk(world, scatter_dim)[rank] for x in reversed(xs)],
                                   dim=gather_dim)
        strided = torch.cat([x.index_select(scatter_dim, torch.arange(
            rank, x.shape[scatter_dim], world)) for x in xs], dim=gather_dim)
        if got["y"].shape == expected.shape and torch.equal(got["y"], reversed_order):
            why = ": the pieces are in reverse rank order: rank 0's piece comes first"
        elif got["y"].shape == expected.shape and torch.equal(got["y"], strided):
            why = (f": rank {rank} got every W-th entry from {rank} (a reshape to (n/W, W)), "
                   f"not the contiguous piece {rank}: x.chunk(W, scatter_dim)")
        try:
            assert_close(got["y"], expected, f"{what}: piece {rank} of every rank's x, joined "
                         f"in rank order", rank, **TIGHT)
        except AssertionError as error:
            raise AssertionError(f"{error}{why}") from None
        assert [op for op, _ in got["forward"]] == ["all_to_all"], (
            f"rank {rank}: {what} ran {got['forward'] or 'no collective'} in the forward: "
            f"expected one all_to_all")
        assert "backward_error" not in got, (
            f"rank {rank}: the backward of {what} failed: {got.get('backward_error')}. The "
            f"gradient of x has x's shape: the exchange the other way round (cut gather_dim, "
            f"join scatter_dim), then (gradient, None, None, None)")
        assert got["grad"] is not None, f"rank {rank}: no gradient reached x through {what}"
        weights = [seeded(200 + r, *expected.shape) for r in range(world)]
        home = torch.cat([c.chunk(world, gather_dim)[rank] for c in weights], dim=scatter_dim)
        assert_close(got["grad"], home, f"the gradient of x through {what}: each piece's "
                     f"gradient sent back home by the reverse exchange", rank, **TIGHT)
        assert [op for op, _ in got["backward"]] == ["all_to_all"], (
            f"rank {rank}: the backward of {what} ran {got['backward'] or 'no collective'}: "
            f"expected one all_to_all (the reverse exchange)")
        assert got["forward"][0][1] == got["backward"][0][1] == nbytes, (
            f"rank {rank}: {what}'s all_to_all took {got['forward'][0][1]} bytes forward and "
            f"{got['backward'][0][1]} backward; x is {nbytes}: send x (and its gradient) once")


def refused_exchange(ctx):
    ex = load_exercise(LESSON)
    x = torch.zeros(2, 2 * ctx.world_size + 1, 3)  # 5 along dim 1, for 2 ranks
    try:
        ex.SeqAllToAll.apply(x, 1, 2, None)
    except ValueError as error:
        return str(error)
    except Exception as error:  # noqa: BLE001 - what the learner's code raised instead
        return f"not a ValueError: {type(error).__name__}: {error}"
    return None


@pytest.mark.task10_6
def test_seq_all_to_all_refuses_a_size_that_does_not_divide(ex):
    """SeqAllToAll raises a ValueError naming 5 and 2 for a scatter_dim of 5 on 2 gloo ranks."""
    raise_if_untouched(ex.SeqAllToAll.forward)
    for rank, message in enumerate(run_on_ranks(refused_exchange, world_size=2)):
        assert message is not None, (
            f"rank {rank}: SeqAllToAll cut 5 entries among 2 ranks without an error: raise a "
            f"ValueError before the all_to_all (chunk would cut 3 and 2, and the ranks would "
            f"disagree on the sizes)")
        assert not message.startswith("not a ValueError"), f"rank {rank}: {message}"
        assert "5" in message and "2" in message, (
            f"rank {rank}: the error should name the size (5) and the number of ranks (2): "
            f"{message!r}")


# -- ulysses_attention ---------------------------------------------------------------------------


def ulysses_run(ctx, batch: int, heads: int, tokens: int, head_dim: int, causal, groups=None):
    """This rank's ulysses_attention (causal None: the default) on its tokens of a sequence every
    rank rebuilds from seeds, then the backward of (out * c).sum(); collectives counted."""
    ex = load_exercise(LESSON)
    group, members, place = make_group(ctx, groups)
    length = tokens * len(members)
    mine = slice(place * tokens, (place + 1) * tokens)
    q, k, v = (seeded(i, batch, heads, length, head_dim)[:, :, mine].clone().requires_grad_(True)
               for i in range(3))
    with CollectiveLog(ex) as forward:
        try:
            if causal is None:
                out = ex.ulysses_attention(q, k, v, group)
            else:
                out = ex.ulysses_attention(q, k, v, group, causal)
        except ValueError as error:  # on inputs the contract accepts: the test says so
            return {"refused": str(error)[:300]}
    found = {"out": out.detach(), "forward": calls_of(forward), "backward": [],
             "members": members, "place": place}
    if out.shape != q.shape:  # the test reports the shape; no backward to run
        return found
    with CollectiveLog(ex) as backward:
        try:
            (out * seeded(10, batch, heads, length, head_dim)[:, :, mine]).sum().backward()
        except (RuntimeError, ValueError) as error:
            return {**found, "backward_error": str(error)[:300]}
    return {**found, "backward": calls_of(backward), "grads": [t.grad for t in (q, k, v)]}


def whole_sequence(batch: int, heads: int, length: int, head_dim: int, causal: bool):
    """out and the gradients of q, k, v of SDPA over the whole sequence, in one process."""
    q, k, v = (seeded(i, batch, heads, length, head_dim).requires_grad_(True) for i in range(3))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    (out * seeded(10, batch, heads, length, head_dim)).sum().backward()
    return out.detach(), [t.grad for t in (q, k, v)]


def check_ulysses(results, batch, heads, tokens, head_dim, causal, world) -> None:
    mask = "causal" if causal in (True, None) else "no mask"
    default = " (causal left to its default, True)" if causal is None else ""
    out, grads = whole_sequence(batch, heads, tokens * world, head_dim, causal in (True, None))
    for rank, got in enumerate(results):
        assert "refused" not in got, (
            f"rank {rank}: ulysses_attention raised ValueError({got.get('refused')!r}) for "
            f"B={batch} H={heads} L={tokens} D={head_dim} on {world} ranks: valid inputs, since "
            f"the heads ({heads}) divide by {world}; the tokens a rank holds (L) need not. The "
            f"first exchange cuts the heads (dim 1) and joins the tokens (dim 2)")
        place = got["place"]
        mine = slice(place * tokens, (place + 1) * tokens)
        case = (f"({mask}{default}, {world} ranks, B={batch} H={heads} L={tokens} "
                f"D={head_dim}, positions {place * tokens}-{(place + 1) * tokens - 1})")
        shape = (batch, heads, tokens, head_dim)
        assert got["out"].shape == shape or got["out"].shape != (
            batch, heads // world, tokens * world, head_dim), (
            f"rank {rank}: ulysses_attention returned {tuple(got['out'].shape)}, the heads' "
            f"layout (B, H/W, W·L, D): send the output back with the exchange the other way "
            f"(SeqAllToAll with dims 2, 1), to (B, H, L, D) = {shape} {case}")
        assert_close(got["out"], out[:, :, mine], f"ulysses_attention's out {case}", rank,
                     **TIGHT)
        assert "backward_error" not in got, (
            f"rank {rank}: the backward through ulysses_attention failed {case}: "
            f"{got.get('backward_error')}. Each exchange's backward is the reverse exchange")
        for name, grad, want in zip("qkv", got["grads"], grads, strict=True):
            assert grad is not None, f"rank {rank}: no gradient reached {name} {case}"
            assert_close(grad, want[:, :, mine], f"the gradient of {name} through "
                         f"ulysses_attention {case}", rank, **TIGHT)


@pytest.mark.task10_6
@pytest.mark.parametrize("world", [2, 4])
@sweep(max_examples=8, batch=st.integers(1, 2), heads_per_rank=st.integers(1, 2),
       tokens=st.integers(1, 3), head_dim=st.integers(1, 4),
       causal=st.sampled_from([True, False, None]))
def test_ulysses_attention_equals_attention_over_the_whole_sequence(ex, world, batch,
                                                                    heads_per_rank, tokens,
                                                                    head_dim, causal):
    """ulysses_attention gives each rank's tokens, every head, what SDPA over the whole sequence
    gives them, and the gradients of q, k and v: on 2 and 4 gloo ranks, 8 generated sizes each (1-3
    tokens a rank, 1-2 heads per rank, head_dim 1-4), causal, not, and by default, in float64."""
    raise_if_untouched(ex.ulysses_attention, ex.SeqAllToAll.forward, ex.SeqAllToAll.backward)
    heads = heads_per_rank * world
    results = run_on_ranks(ulysses_run, batch, heads, tokens, head_dim, causal,
                           world_size=world)
    as_one_failure(check_ulysses, results, batch, heads, tokens, head_dim, causal, world)


@pytest.mark.task10_6
@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_attention_sends_each_tensor_once(ex, world):
    """ulysses_attention's collectives are all-to-alls whose inputs add up to exactly q, k, v and
    out (4 x one rank's (B, H, L, D)) in the forward, and the same in the backward: on 2 and 4 gloo
    ranks, counted with CollectiveLog.

    An all-gather of the keys would give the right numbers and hold the whole sequence."""
    raise_if_untouched(ex.ulysses_attention, ex.SeqAllToAll.forward, ex.SeqAllToAll.backward)
    batch, heads, tokens, head_dim = 2, 2 * world, 3, 4
    local = 8 * batch * heads * tokens * head_dim
    results = run_on_ranks(ulysses_run, batch, heads, tokens, head_dim, True, world_size=world)
    for rank, got in enumerate(results):
        for direction in ("forward", "backward"):
            calls = got[direction]
            others = sorted({op for op, _ in calls if op != "all_to_all"})
            assert not others, (
                f"rank {rank}: ulysses_attention's {direction} ran {others} besides its "
                f"all-to-alls ({calls}): Ulysses exchanges q, k, v and the output, each once, "
                f"and nothing else")
            sent = sum(payload for _, payload in calls)
            assert sent == 4 * local, (
                f"rank {rank}: ulysses_attention's {direction} all-to-alls took {sent} bytes "
                f"({len(calls)} call(s)); q, k, v and the output are 4 x {local}: each crosses "
                f"once" + (" (the backward: the gradient of out one way, those of q, k, v "
                           "back)" if direction == "backward" else ""))


def refused_heads(ctx):
    ex = load_exercise(LESSON)
    q = torch.zeros(1, 3, 2, 4)  # 3 heads for 2 ranks
    try:
        with CollectiveLog(ex) as log:
            ex.ulysses_attention(q, q.clone(), q.clone())
    except ValueError as error:
        return str(error), calls_of(log)
    except Exception as error:  # noqa: BLE001 - what the learner's code raised instead
        return f"not a ValueError: {type(error).__name__}: {error}", []
    return None, []


@pytest.mark.task10_6
def test_ulysses_attention_refuses_heads_that_do_not_divide(ex):
    """ulysses_attention with 3 heads on 2 gloo ranks raises a ValueError that names the heads, 3
    and 2, before any collective."""
    raise_if_untouched(ex.ulysses_attention)
    for rank, (message, calls) in enumerate(run_on_ranks(refused_heads, world_size=2)):
        assert message is not None, (
            f"rank {rank}: ulysses_attention took 3 heads on 2 ranks without an error: raise a "
            f"ValueError (each rank attends whole heads)")
        assert not message.startswith("not a ValueError"), f"rank {rank}: {message}"
        assert "head" in message.lower() and "3" in message and "2" in message, (
            f"rank {rank}: the error should say that the heads (3) do not divide among the "
            f"ranks (2): {message!r}")
        assert not calls, f"rank {rank}: check the heads before any exchange; it ran {calls}"


@pytest.mark.task10_6
def test_ulysses_attention_stays_within_its_group(ex):
    """ulysses_attention with `group=` exchanges within the group: on 4 gloo ranks in groups [0, 2]
    and [1, 3], causal, the out and gradients of attention over the group's own 2 x 3 tokens."""
    raise_if_untouched(ex.ulysses_attention, ex.SeqAllToAll.forward, ex.SeqAllToAll.backward)
    results = run_on_ranks(ulysses_run, 1, 4, 3, 2, True, [[0, 2], [1, 3]], world_size=4)
    for rank, got in enumerate(results):
        assert got["out"].shape == (1, 4, 3, 2), (
            f"rank {rank}: with group={got['members']} ulysses_attention returned "
            f"{tuple(got['out'].shape)}, not (1, 4, 3, 2): exchange within the group "
            f"(dist.get_world_size(group), and group= to every exchange)")
    check_ulysses(results, 1, 4, 3, 2, True, 2)
