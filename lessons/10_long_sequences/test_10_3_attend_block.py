"""Lesson 10, task10_3: attend_block, one step of ring attention: this rank's queries against a
block of keys from anywhere in the sequence, masked by global positions, returning the
log-sum-exp beside the output; swept against attention worked out the slow way.

    pytest lessons/10_long_sequences -m task10_3
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.compare import assert_close
from harness.sweep import st, sweep
from lesson10.common import TIGHT, reference_attention, seeded

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task10_3": {
        "out: softmax of each row of scores times v": [
            "test_attend_block_equals_attention_over_the_block",
            "test_attend_block_without_a_mask_is_torchs_attention"],
        "lse: each row's log-sum-exp of the scores": [
            "test_attend_block_equals_attention_over_the_block"],
        "scale defaults to 1/sqrt(D)": ["test_attend_block_without_a_mask_is_torchs_attention",
                                        "test_attend_block_equals_attention_over_the_block"],
        "a scale given is used, 0.0 included": [
            "test_attend_block_equals_attention_over_the_block"],
        "causal: the query at p sees the keys at positions <= p, global positions": [
            "test_attend_block_masks_by_global_position",
            "test_attend_block_equals_attention_over_the_block"],
        "causal defaults to True": ["test_attend_block_masks_by_global_position"],
        "not causal: every key is seen": ["test_attend_block_without_a_mask_is_torchs_attention"],
        "a row that sees nothing: out 0, lse -inf, no NaN in outputs or gradients": [
            "test_attend_block_gives_zeros_to_a_row_that_sees_nothing"],
        "differentiable by autograd": ["test_attend_block_equals_attention_over_the_block"],
        "no overflow with scores in the hundreds": ["test_attend_block_does_not_overflow"],
    },
}


def loss_of(out, lse, c, d):
    """A loss that uses every out and every finite lse (a row that sees nothing has none)."""
    finite = torch.isfinite(lse)
    return (out * c).sum() + (torch.where(finite, lse, torch.zeros_like(lse)) * d).sum()


def run(function, q, k, v, qp, kp, causal, scale, c, d):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, lse = function(q, k, v, qp, kp, causal, scale)
    loss_of(out, lse, c, d).backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def diagnose(ex_out, q, k, v, qp, kp, causal, scale, ex_lse=None) -> str:
    """A guess, only when the numbers leave no doubt."""
    if causal and ex_lse is not None:
        blind = ~(kp[None, :] <= qp[:, None]).any(-1)  # the rows that see no key
        seen = ex_lse[..., blind]
        if blind.any() and torch.isfinite(seen).all() and (seen < -1e4).all():
            return (": a row that sees no key got the mean of the values and an lse near "
                    f"{seen.max().item():.3g}: masking with a large negative number instead of "
                    "-inf leaves such a row a softmax over the masked keys. Mask with -inf, "
                    "and give a row that sees nothing zeros and lse -inf")
    if causal:
        local = reference_attention(q, k, v, torch.arange(len(qp)), torch.arange(len(kp)),
                                    True, scale)[0]
        if not torch.allclose(local, reference_attention(q, k, v, qp, kp, True, scale)[0]) \
                and torch.allclose(ex_out, local):
            return (": that is a mask by place in the block (0, 1, 2, ...); mask by the "
                    "positions given, the tokens' places in the whole sequence")
        mirrored = reference_attention(q, k, v, -qp, -kp, True, scale)[0]
        if torch.allclose(ex_out, mirrored):
            return ": the mask is the wrong way round: a query sees the keys at or BEFORE it"
    if scale is None and torch.allclose(
            ex_out, reference_attention(q, k, v, qp, kp, causal, 1.0)[0]):
        return ": the scores were not scaled: scale defaults to 1/sqrt(head_dim)"
    if scale == 0 and torch.allclose(ex_out, reference_attention(q, k, v, qp, kp, causal)[0]):
        return (": scale=0.0 was replaced by the default 1/sqrt(head_dim): 0.0 is falsy, so "
                "`scale or default` drops it; test `scale is None`")
    return ""


positions = st.lists(st.integers(0, 24), min_size=1, max_size=6, unique=True).map(sorted)


@pytest.mark.task10_3
@pytest.mark.parametrize("causal", [False, True])
def test_attend_block_without_a_mask_is_torchs_attention(ex, causal):
    """attend_block over a whole sequence of 7 tokens, causal or not, gives
    `F.scaled_dot_product_attention`'s output and the log-sum-exp of the (masked) scores, in
    float64."""
    q, k, v = (seeded(10 + i, 2, 3, 7, 5) for i in range(3))
    positions = torch.arange(7)
    out, lse = ex.attend_block(q, k, v, positions, positions, causal)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    why = diagnose(out, q, k, v, positions, positions, causal, None)
    try:
        assert_close(out, want, f"attend_block's out over a whole sequence (causal={causal}), "
                     f"against F.scaled_dot_product_attention", **TIGHT)
    except AssertionError as error:
        raise AssertionError(f"{error}{why}") from None
    scores = (q @ k.transpose(-2, -1)) / 5 ** 0.5
    if causal:
        scores = scores.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    assert_close(lse, torch.logsumexp(scores, -1), f"attend_block's lse (causal={causal})",
                 **TIGHT)


@pytest.mark.task10_3
def test_attend_block_masks_by_global_position(ex):
    """attend_block masks by global positions: queries at 8-11 see every key at 4-7, as unmasked
    attention does; with positions 0-3 and causal left to its default, it is torch's causal
    attention."""
    q, k, v = (seeded(20 + i, 1, 2, 4, 3) for i in range(3))
    qp, kp = torch.arange(8, 12), torch.arange(4, 8)
    out, _ = ex.attend_block(q, k, v, qp, kp, True)
    want = F.scaled_dot_product_attention(q, k, v)  # nothing is masked
    why = diagnose(out, q, k, v, qp, kp, True, None)
    try:
        assert_close(out, want, "attend_block's out for queries at 8-11 and keys at 4-7 "
                     "(causal: every key is visible)", **TIGHT)
    except AssertionError as error:
        raise AssertionError(f"{error}{why}") from None
    positions = torch.arange(4)
    assert_close(ex.attend_block(q, k, v, positions, positions)[0],
                 F.scaled_dot_product_attention(q, k, v, is_causal=True),
                 "attend_block's out with causal left to its default (True)", **TIGHT)


@pytest.mark.task10_3
def test_attend_block_does_not_overflow(ex):
    """attend_block stays finite and right in float32 with scores in the hundreds (q and k scaled by
    12): out and lse against the float64 reference.

    float32 overflows past e^88, as large activations can make it."""
    q = seeded(50, 1, 2, 5, 4, dtype=torch.float32, scale=12.0)
    k, v = seeded(51, 1, 2, 5, 4, dtype=torch.float32, scale=12.0), seeded(52, 1, 2, 5, 4,
                                                                           dtype=torch.float32)
    positions = torch.arange(5)
    out, lse = ex.attend_block(q, k, v, positions, positions, True)
    if not (torch.isfinite(out).all() and torch.isfinite(lse).all()):
        raise AssertionError(
            "attend_block returned inf or NaN for scores in the hundreds (float32: e^88 "
            "overflows): subtract each row's largest score before exponentiating")
    want_out, want_lse = reference_attention(q.double(), k.double(), v.double(), positions,
                                             positions, True)
    assert_close(lse, want_lse.float(), "attend_block's lse with scores in the hundreds "
                 "(float32)", rtol=1e-5, atol=1e-3)
    assert_close(out, want_out.float(), "attend_block's out with scores in the hundreds "
                 "(float32)", rtol=1e-4, atol=1e-4)


@pytest.mark.task10_3
def test_attend_block_gives_zeros_to_a_row_that_sees_nothing(ex):
    """A query row that sees no key (queries at 0, 1, 6, 7 against keys at 4-7) gets an output of
    zeros and lse -inf, with no NaN; the other rows match the reference, and the gradients of q, k
    and v stay finite."""
    q, k, v = (seeded(30 + i, 2, 2, 4, 3).requires_grad_(True) for i in range(3))
    qp, kp = torch.tensor([0, 1, 6, 7]), torch.arange(4, 8)
    out, lse = ex.attend_block(q, k, v, qp, kp, True)
    assert not torch.isnan(out).any(), (
        "attend_block's out has NaN on the rows that see no key (queries at 0 and 1, keys at "
        "4-7): a softmax over nothing but -inf is 0/0. Give those rows zeros")
    why = diagnose(out, q, k, v, qp, kp, True, None, lse.detach())
    try:
        assert_close(out[:, :, :2], torch.zeros(2, 2, 2, 3, dtype=torch.float64),
                     "out on the rows that see no key", **TIGHT)
    except AssertionError as error:
        raise AssertionError(f"{error}{why}") from None
    assert torch.isneginf(lse[:, :, :2]).all(), (
        f"lse on the rows that see no key should be -inf (the log of an empty sum), got "
        f"{lse[:, :, :2].flatten().tolist()}")
    want_out, want_lse = reference_attention(q.detach(), k.detach(), v.detach(), qp, kp, True)
    assert_close(out[:, :, 2:], want_out[:, :, 2:], "out on the rows that see keys", **TIGHT)
    assert_close(lse[:, :, 2:], want_lse[:, :, 2:], "lse on the rows that see keys", **TIGHT)
    c, d = seeded(40, 2, 2, 4, 3), seeded(41, 2, 2, 4)
    loss_of(out, lse, c, d).backward()
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        assert tensor.grad is not None and torch.isfinite(tensor.grad).all(), (
            f"the gradient of {name} is {'missing' if tensor.grad is None else 'NaN or inf'} "
            f"when some rows see no key: the branch torch.where does not take is "
            f"differentiated too, so keep it finite (divide by 1, take log(1) there)")


@pytest.mark.task10_3
@sweep(max_examples=40, batch=st.integers(1, 2), heads=st.integers(1, 2), dim=st.integers(1, 4),
       q_positions=positions, k_positions=positions, causal=st.booleans(),
       scale=st.sampled_from([None, 0.0, 0.3, 1.7]), seed=st.integers(0, 10_000))
def test_attend_block_equals_attention_over_the_block(ex, batch, heads, dim, q_positions,
                                                      k_positions, causal, scale, seed):
    """attend_block equals attention worked out the slow way, on 40 generated cases in float64: out,
    lse and the gradients of q, k and v for up to 6 query and key positions in 0 to 24, causal or
    not, with scale None, 0, 0.3 or 1.7."""
    qp, kp = torch.tensor(q_positions), torch.tensor(k_positions)
    q = seeded(seed, batch, heads, len(qp), dim)
    k, v = seeded(seed + 1, batch, heads, len(kp), dim), seeded(seed + 2, batch, heads, len(kp),
                                                                 dim)
    c, d = seeded(seed + 3, batch, heads, len(qp), dim), seeded(seed + 4, batch, heads, len(qp))
    got = run(ex.attend_block, q, k, v, qp, kp, causal, scale, c, d)
    want = run(reference_attention, q, k, v, qp, kp, causal, scale, c, d)
    case = (f"(queries at {q_positions}, keys at {k_positions}, causal={causal}, "
            f"scale={scale})")
    why = diagnose(got[0], q, k, v, qp, kp, causal, scale, got[1])
    nan = [name for name, t in zip(("out", "lse"), got[:2], strict=True) if torch.isnan(t).any()]
    assert not nan, (f"attend_block returned NaN in {nan} {case}: a row that sees no key gets "
                     f"an out row of zeros and lse -inf")
    for name, mine, theirs in zip(("out", "lse"), got[:2], want[:2], strict=True):
        try:
            assert_close(mine, theirs, f"attend_block's {name} {case}", **TIGHT)
        except AssertionError as error:
            raise AssertionError(f"{error}{why}") from None
    for name, mine, theirs in zip(("q", "k", "v"), got[2:], want[2:], strict=True):
        assert mine is not None, (f"no gradient reached {name} through attend_block {case}: use "
                                  f"torch operations only, no .detach() or .item()")
        assert torch.isfinite(mine).all(), (f"the gradient of {name} through attend_block has "
                                            f"NaN or inf {case}")
        assert_close(mine, theirs, f"the gradient of {name} through attend_block {case}",
                     **TIGHT)
