"""Lesson 10, task10_2: merge_partials, the online-softmax (log-sum-exp) merge of two partial
attentions, swept against attention over the union of the keys; in float32 with scores in the
hundreds; with rows one side did not see.

    pytest lessons/10_long_sequences -m task10_2
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
    "task10_2": {
        "lse = log(exp(lse_a) + exp(lse_b))": ["test_merge_equals_attention_over_both_key_sets"],
        "out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b":
            ["test_merge_equals_attention_over_both_key_sets"],
        "differentiable by autograd": ["test_merge_equals_attention_over_both_key_sets"],
        "no overflow with lse in the hundreds, row by row": ["test_merge_does_not_overflow"],
        "no NaN where one side is -inf, in the outputs and the gradients":
            ["test_merge_takes_the_other_side_where_one_saw_nothing"],
    },
}


def partial(q, k, v):
    positions = torch.arange(k.shape[-2])
    return reference_attention(q, k, v, positions, positions, causal=False)


def merged_and_grads(ex, q, k, v, split: int, c, d):
    """Merge the attentions over keys [:split] and [split:]; its loss's gradients."""
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out_a, lse_a = partial(q, k[..., :split, :], v[..., :split, :])
    out_b, lse_b = partial(q, k[..., split:, :], v[..., split:, :])
    out, lse = ex.merge_partials(out_a, lse_a, out_b, lse_b)
    ((out * c).sum() + (lse * d).sum()).backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def whole_and_grads(q, k, v, c, d):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v)
    lse = torch.logsumexp((q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5, dim=-1)
    ((out * c).sum() + (lse * d).sum()).backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def diagnose(out, out_a, out_b, lse, lse_a, lse_b) -> str:
    if torch.allclose(lse, torch.maximum(lse_a, lse_b)):
        return (": lse is the larger of the two; it is the log of the sum of their "
                "exponentials, which is larger than either")
    if torch.allclose(out, (out_a + out_b) / 2):
        return (": out is the plain average of the two; weigh each by its share of the "
                "softmax's denominator, exp(lse_a - lse) and exp(lse_b - lse)")
    return ""


@pytest.mark.task10_2
@pytest.mark.parametrize("level", [100.0, 300.0, 1000.0, "rows apart"])
def test_merge_does_not_overflow(ex, level):
    """merge_partials stays finite and right in float32 with lse near 100, 300 and 1000, and with
    rows whose lse run from 0 to 1000: out and lse against the same merge in float64
    (`torch.logaddexp`).

    float32 overflows past e^88; one maximum for the whole tensor would underflow the rows far below
    it."""
    out_a, out_b = seeded(1, 2, 3, 4, dtype=torch.float32), seeded(2, 2, 3, 4,
                                                                      dtype=torch.float32)
    rows = torch.tensor([0.0, 500.0, 1000.0]) if level == "rows apart" else level
    lse_a = rows + seeded(3, 2, 3, dtype=torch.float32)
    lse_b = rows + seeded(4, 2, 3, dtype=torch.float32)
    level = "0 to 1000" if level == "rows apart" else f"{level:g}"
    out, lse = ex.merge_partials(out_a, lse_a, out_b, lse_b)
    a, b = lse_a.double(), lse_b.double()
    want_lse = torch.logaddexp(a, b)
    want_out = (torch.exp(a - want_lse)[..., None] * out_a.double()
                + torch.exp(b - want_lse)[..., None] * out_b.double())
    if not (torch.isfinite(out).all() and torch.isfinite(lse).all()):
        fix = ("subtract each row's larger lse before exponentiating, lse = m + "
               "log(exp(lse_a - m) + exp(lse_b - m)) with m = max(lse_a, lse_b), element by "
               "element")
        if torch.isneginf(lse).any():  # every exponential of a row came out 0
            raise AssertionError(
                f"merge_partials returned lse -inf for lse near {level} in float32: a row far "
                f"below the maximum subtracted underflows (exp(-1000) is 0 in float32, and "
                f"log(0) is -inf), as with one maximum for the whole tensor: {fix}")
        raise AssertionError(
            f"merge_partials returned inf or NaN for lse near {level} in float32 (e^88 "
            f"overflows): {fix}")
    why = diagnose(out, out_a, out_b, lse, lse_a, lse_b)
    try:
        assert_close(lse, want_lse.float(), f"merge_partials' lse near {level} (float32)",
                     rtol=1e-6, atol=2e-4)
        # float32 keeps lse near 1000 to 6e-5, and so each weight e^(lse_a - lse) to about 1e-4
        assert_close(out, want_out.float(), f"merge_partials' out near {level} (float32)",
                     rtol=1e-5, atol=2e-4)
    except AssertionError as error:
        raise AssertionError(f"{error}{why}") from None


@pytest.mark.task10_2
@pytest.mark.parametrize("empty", ["a", "b"])
def test_merge_takes_the_other_side_where_one_saw_nothing(ex, empty):
    """Where one side saw no key (lse -inf, out 0), merge_partials returns the other side's out and
    lse exactly, with no NaN and finite gradients for every input, whichever side is empty."""
    outs = [seeded(5, 2, 4, 3).requires_grad_(True), seeded(6, 2, 4, 3).requires_grad_(True)]
    lses = [seeded(7, 2, 4).requires_grad_(True), seeded(8, 2, 4).requires_grad_(True)]
    blank = 0 if empty == "a" else 1
    rows = torch.tensor([True, False, True, False])
    out_x = torch.where(rows[:, None], torch.zeros(()), outs[blank])
    lse_x = torch.where(rows, torch.tensor(float("-inf"), dtype=torch.float64), lses[blank])
    sides = [(out_x, lse_x), (outs[1 - blank], lses[1 - blank])]
    if blank:
        sides.reverse()
    out, lse = ex.merge_partials(*sides[0], *sides[1])
    nan = [name for name, t in (("out", out), ("lse", lse)) if torch.isnan(t).any()]
    assert not nan, (f"merge_partials gave NaN in {nan} where side {empty} saw no key (its "
                     f"lse -inf): exp(-inf - m) is 0 as long as m, the larger lse, is finite")
    other_out, other_lse = outs[1 - blank].detach(), lses[1 - blank].detach()
    assert_close(out[:, rows], other_out[:, rows], f"out where side {empty} saw nothing (the "
                 f"other side's out, unchanged)", **TIGHT)
    assert_close(lse[:, rows], other_lse[:, rows], f"lse where side {empty} saw nothing (the "
                 f"other side's lse)", **TIGHT)
    (out.sum() + lse.sum()).backward()
    for name, tensor in (("out", outs[0]), ("out", outs[1]), ("lse", lses[0]), ("lse", lses[1])):
        assert tensor.grad is not None and torch.isfinite(tensor.grad).all(), (
            f"the gradient of an input {name} through merge_partials is "
            f"{'missing' if tensor.grad is None else 'NaN or inf'} where side {empty} saw no "
            f"key: the backward must stay finite too")


@pytest.mark.task10_2
@sweep(batch=st.integers(1, 2), heads=st.integers(1, 3), queries=st.integers(1, 5),
       keys_a=st.integers(1, 5), keys_b=st.integers(1, 5), dim=st.integers(1, 4),
       seed=st.integers(0, 10_000))
def test_merge_equals_attention_over_both_key_sets(ex, batch, heads, queries, keys_a, keys_b,
                                                   dim, seed):
    """merge_partials of the attentions over two disjoint key sets is
    `F.scaled_dot_product_attention` over their union: out, lse and the gradients of q, k and v to
    1e-9 in float64, on 25 generated shapes (1 to 5 keys a side, 1 to 5 queries, head_dim 1 to 4).
    """
    q = seeded(seed, batch, heads, queries, dim)
    k = seeded(seed + 1, batch, heads, keys_a + keys_b, dim)
    v = seeded(seed + 2, batch, heads, keys_a + keys_b, dim)
    c, d = seeded(seed + 3, batch, heads, queries, dim), seeded(seed + 4, batch, heads, queries)
    got = merged_and_grads(ex, q, k, v, keys_a, c, d)
    want = whole_and_grads(q, k, v, c, d)
    sizes = f"(keys {keys_a} + {keys_b}, queries {queries}, head_dim {dim})"
    with torch.no_grad():
        out_a, lse_a = partial(q, k[..., :keys_a, :], v[..., :keys_a, :])
        out_b, lse_b = partial(q, k[..., keys_a:, :], v[..., keys_a:, :])
    why = diagnose(got[0], out_a, out_b, got[1], lse_a, lse_b)
    for name, mine, theirs in zip(("out", "lse"), got[:2], want[:2], strict=True):
        try:
            assert_close(mine, theirs, f"merge_partials' {name} {sizes}", **TIGHT)
        except AssertionError as error:
            raise AssertionError(f"{error}{why}") from None
    for name, mine, theirs in zip(("q", "k", "v"), got[2:], want[2:], strict=True):
        assert mine is not None, (f"no gradient reached {name} through merge_partials: compute "
                                  f"it with torch operations, without .detach() or .item()")
        assert_close(mine, theirs, f"the gradient of {name} through merge_partials {sizes}",
                     **TIGHT)
