"""Lesson 11, task11_6: grouped_experts, dropless experts as one grouped matrix multiply per
weight, swept against a plain loop over the experts (the output and four gradients), with the
grouped multiply's calls and offsets watched; and the refusals.

    pytest lessons/11_mixture_of_experts -m task11_6
"""

from __future__ import annotations

import pytest
import torch

from harness.compare import assert_close
from harness.sweep import st, sweep
from lesson11.common import loop_experts, names_shape

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task11_6": {
        "output: per token, the sum over its k assignments of weight x gelu(x @ w_in) @ w_out":
            ["test_grouped_experts_match_a_loop"],
        "rows sorted by expert, and put back at their assignments by the inverse of the sort":
            ["test_grouped_experts_match_a_loop"],
        "each group padded with zero rows to a multiple of align; the padding dropped after":
            ["test_grouped_experts_match_a_loop", "test_grouped_matmul_sees_the_padded_groups"],
        "grouped_matmul twice (w_in, w_out), offs the int32 ends of the padded groups":
            ["test_grouped_matmul_sees_the_padded_groups"],
        "differentiable with respect to tokens, weights, w_in and w_out":
            ["test_grouped_experts_match_a_loop"],
        "align below 1, an expert id outside 0..E-1, weights not shaped like experts: ValueError":
            ["test_grouped_experts_refuse_what_they_cannot_do"],
    },
}

WIDTH, HIDDEN = 8, 16  # float32 rows of 32 and 64 bytes: what grouped_mm takes
LOOSE = {"rtol": 1e-5, "atol": 1e-5}  # float32: the sums over rows run in another order


def layer_inputs(seed: int, tokens: int, num_experts: int, k: int, dtype=torch.float32,
                 idle: bool = False):
    """Seeded tokens, routing (k distinct experts a token, drawn unevenly: expert 0 is
    popular, the last one idle when ``idle``), gate weights and expert weights."""
    generator = torch.Generator().manual_seed(seed)
    pool = num_experts - 1 if idle and num_experts > k else num_experts
    favour = torch.arange(pool, 0, -1, dtype=torch.float64) ** 2  # uneven loads
    experts = torch.stack([torch.multinomial(favour, k, generator=generator)
                           for _ in range(tokens)])
    tokens_ = torch.randn(tokens, WIDTH, generator=generator, dtype=dtype)
    weights = torch.rand(tokens, k, generator=generator, dtype=dtype) + 0.1
    w_in = torch.randn(num_experts, WIDTH, HIDDEN, generator=generator, dtype=dtype) / WIDTH**0.5
    w_out = torch.randn(num_experts, HIDDEN, WIDTH, generator=generator, dtype=dtype) / HIDDEN**0.5
    return tokens_, experts, weights, w_in, w_out


def padded_sizes(experts: torch.Tensor, num_experts: int, align: int) -> list[int]:
    counts = torch.bincount(experts.flatten(), minlength=num_experts)
    return ((counts + align - 1) // align * align).tolist()


def output_hint(out, tokens, experts, weights, w_in, w_out, align) -> str:
    """Name the mistake when the output equals what exactly that mistake computes."""
    with torch.no_grad():
        close = lambda other: torch.allclose(out, other, **LOOSE)  # noqa: E731
        if close(loop_experts(tokens, experts, weights, w_in, w_out, weigh="not")):
            return (": that is each token's experts summed without their gate weights; weigh "
                    "each row by its weight before summing over the k choices")
        if close(loop_experts(tokens, experts, weights, w_in, w_out, weigh="before")):
            return (": that weighs each token before its expert runs (x * weight through the "
                    "gelu); the gate weight multiplies the expert's output, after w_out")
        k = experts.shape[1]
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        # every assignment's expert output, unweighted, in flat order t * k + j
        each = torch.stack([torch.nn.functional.gelu(tokens[t] @ w_in[flat[t * k + j]])
                            @ w_out[flat[t * k + j]]
                            for t in range(experts.shape[0]) for j in range(k)])
        by_sort = each[order]  # what the grouped multiply gives, in sorted order
        weigh = lambda rows: (rows.view(*experts.shape, -1) * weights.unsqueeze(-1)).sum(1)  # noqa: E731
        if len(order) > 1 and not torch.equal(order, torch.argsort(order)) \
                and close(weigh(by_sort[order])):
            return (": the rows were put back with the sort order itself (rows[order]); the "
                    "row at sorted place p belongs to assignment order[p]: index with the "
                    "inverse permutation (argsort(order)), or index_copy at order")
        sizes = padded_sizes(experts, w_in.shape[0], align)
        if sum(sizes) > len(order):
            counts = torch.bincount(flat, minlength=w_in.shape[0]).tolist()
            buffer = each.new_zeros(sum(sizes), each.shape[1])
            start = place = 0
            for size, count in zip(sizes, counts, strict=True):
                buffer[start:start + count] = by_sort[place:place + count]
                start, place = start + size, place + count
            kept_first = buffer[:len(order)]  # the buffer's first T * k rows, padding among them
            if close(weigh(kept_first.new_zeros(kept_first.shape).index_copy(0, order,
                                                                             kept_first))):
                return (": that keeps the padded buffer's first T * k rows, padding rows among "
                        "them; drop the padding by taking each assignment's own row of the "
                        "buffer (the rows you wrote the tokens to)")
    return ""


@pytest.mark.task11_6
@pytest.mark.parametrize("align", [None, 3])
def test_grouped_matmul_sees_the_padded_groups(ex, monkeypatch, align):
    """grouped_experts calls grouped_matmul twice (w_in, then w_out), each time on one buffer of
    every expert's rows with offs the int32 ends of groups padded to a multiple of align: loads
    7, 0, 3, 1 on 4 experts (an idle one), align 3 and the default, 8, float32.

    The buffer may be longer than the last offset (grouped_mm ignores the rows past it), but each
    group's rows are its expert's, padding included."""
    tokens, experts, weights, w_in, w_out = layer_inputs(0, 11, 4, 1)
    experts = torch.tensor([0] * 7 + [2] * 3 + [3]).view(11, 1)
    calls = []
    given = ex.grouped_matmul

    def watched(x, w, offs):
        calls.append((tuple(x.shape), w.shape[0], offs.dtype, offs.tolist()))
        return given(x, w, offs)

    monkeypatch.setattr(ex, "grouped_matmul", watched)
    if align is None:  # the default
        out, align = ex.grouped_experts(tokens, experts, weights, w_in, w_out), 8
        where = "grouped_experts(loads [7, 0, 3, 1] on 4 experts, align left at its default, 8)"
    else:
        out = ex.grouped_experts(tokens, experts, weights, w_in, w_out, align=align)
        where = f"grouped_experts(loads [7, 0, 3, 1] on 4 experts, align={align})"
    assert len(calls) == 2, (
        f"{where} called grouped_matmul {len(calls)} times; run the experts as one grouped "
        f"multiply per weight: grouped_matmul(buffer, w_in, offs), then grouped_matmul(hidden, "
        f"w_out, offs), not a loop over the experts")
    sizes = padded_sizes(experts, 4, align)
    ends = torch.tensor(sizes).cumsum(0).tolist()
    for (shape, groups, dtype, offs), weight in zip(calls, ("w_in", "w_out"), strict=True):
        assert groups == 4, f"{where}: grouped_matmul got {groups} groups of {weight}, expected 4"
        assert dtype == torch.int32, f"{where}: offs is {dtype}; grouped_mm takes int32"
        if offs == [7, 7, 10, 11] and offs != ends:
            raise AssertionError(
                f"{where}: offs {offs} end the groups without their padding; the buffer pads "
                f"each group to a multiple of {align} rows ({sizes}), so the ends are {ends}: "
                f"offs must count the padding rows too")
        assert offs == ends, (f"{where}: grouped_matmul's offs with {weight} were {offs}, "
                              f"expected {ends}, the ends of the groups padded to {sizes}")
        assert shape[0] >= ends[-1], f"{where}: the buffer has {shape[0]} rows, offs end at " \
                                     f"{ends[-1]}"
    try:
        assert_close(out, loop_experts(tokens, experts, weights, w_in, w_out),
                     f"{where}: output", **LOOSE)
    except AssertionError as error:
        hint = output_hint(out.detach(), tokens, experts, weights, w_in, w_out, align)
        raise AssertionError(f"{error}{hint}") from None


@pytest.mark.task11_6
@sweep(max_examples=30, tokens=st.integers(1, 12), num_experts=st.integers(1, 5),
       two=st.booleans(), align=st.sampled_from([1, 3, 8]), idle=st.booleans(),
       double=st.booleans(), seed=st.integers(0, 2**16))
def test_grouped_experts_match_a_loop(ex, tokens, num_experts, two, align, idle, double, seed):
    """grouped_experts equals a plain loop over the experts on 30 generated routings (1 to 12
    tokens, 1 to 5 experts with uneven loads, one idle or not, k = 1 and 2, align 1, 3 and 8,
    float32 and float64): the output and the gradients of tokens, weights, w_in and w_out."""
    k = 2 if two and num_experts >= 2 else 1
    dtype = torch.float64 if double else torch.float32
    tolerance = {"rtol": 1e-9, "atol": 1e-9} if double else LOOSE
    inputs = layer_inputs(seed, tokens, num_experts, k, dtype, idle)
    tokens_, experts, weights, w_in, w_out = inputs
    mine = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    want = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    where = (f"grouped_experts({tokens} tokens, experts {experts.tolist()}, {num_experts} "
             f"experts, align={align}, {dtype})")
    out = ex.grouped_experts(*mine, align=align)
    expected = loop_experts(*want)
    try:
        assert_close(out, expected.detach(), f"{where}: output", **tolerance)
    except AssertionError as error:
        hint = output_hint(out.detach(), *inputs, align) if out.shape == expected.shape else ""
        raise AssertionError(f"{error}{hint}") from None
    assert out.requires_grad, (f"{where}: the output has no gradient; keep the tokens, weights "
                               f"and expert weights in the graph (no .detach(), no .tolist())")
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype)
    names = ("tokens", "weights", "w_in", "w_out")
    leaves = [mine[i] for i in (0, 2, 3, 4)]
    grads = torch.autograd.grad((out * probe).sum(), leaves, allow_unused=True)
    want_grads = torch.autograd.grad((expected * probe).sum(), [want[i] for i in (0, 2, 3, 4)])
    for name, grad, want_grad in zip(names, grads, want_grads, strict=True):
        assert grad is not None, f"{where}: {name} gets no gradient from the output"
        assert_close(grad, want_grad, f"{where}: the gradient of {name}", **tolerance)


@pytest.mark.task11_6
@pytest.mark.parametrize("case", ["align 0", "id 4 of 4", "id -1", "weights (3, 2)"])
def test_grouped_experts_refuse_what_they_cannot_do(ex, case):
    """grouped_experts raises a ValueError naming the number for align 0, an expert id of 4 or
    -1 with 4 experts, and gate weights shaped (3, 2) for experts shaped (3, 1)."""
    tokens, experts, weights, w_in, w_out = layer_inputs(1, 3, 4, 1)
    align, named = 8, "4"
    if case == "align 0":
        align, named = 0, "0"
    elif case == "id 4 of 4":
        experts = torch.tensor([[0], [4], [1]])
    elif case == "id -1":
        experts, named = torch.tensor([[0], [-1], [1]]), "-1"
    else:
        weights, named = torch.ones(3, 2), "(3, 2)"
    with pytest.raises(ValueError) as raised:
        ex.grouped_experts(tokens, experts, weights, w_in, w_out, align=align)
    said = str(raised.value)
    assert (names_shape(said, (3, 2)) if case == "weights (3, 2)" else named in said), (
        f"grouped_experts with {case}: the message should name {named}: {raised.value}")
