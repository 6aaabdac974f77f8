"""Lesson 11, task11_7: biased_route and update_bias, DeepSeek-V3's sigmoid routing with a
per-expert bias that steers only the choice, and the bias's update after a step; swept against
loops written from the paper's rule, and the refusals.

    pytest lessons/11_mixture_of_experts -m task11_7
"""

from __future__ import annotations

import pytest
import torch

from harness.compare import assert_close
from harness.sweep import st, sweep
from lesson11.common import (
    TIGHT,
    assert_routed_as,
    loop_biased_route,
    loop_update_bias,
    names_shape,
    seeded,
)

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task11_7": {
        "experts: the k largest sigmoid(logits) + bias, largest first":
            ["test_biased_route_matches_a_loop", "test_the_bias_moves_the_choice_only"],
        "weights: the chosen sigmoid affinities normalised among the chosen, no bias in them":
            ["test_biased_route_matches_a_loop", "test_the_bias_moves_the_choice_only"],
        "weights differentiable with respect to logits": ["test_biased_route_matches_a_loop"],
        "k outside 1..E, or a bias not (E,): ValueError": ["test_biased_route_refuses"],
        "update: down by rate when overloaded, up when underloaded, kept at the mean":
            ["test_update_bias_follows_the_sign_of_the_load_error"],
        "update: a new tensor of bias's dtype, bias left as it was":
            ["test_update_bias_follows_the_sign_of_the_load_error"],
        "a negative rate, or a load not shaped like bias: ValueError":
            ["test_update_bias_refuses"],
    },
}


def weights_hint(weights, logits, bias, k) -> str:
    """Name the mistake when the weights equal what exactly that mistake computes."""
    for weigh, hint in (
            ("s + b", ": those are the chosen s + bias normalised; the bias only chooses the "
                      "experts: the weights normalise the affinities s alone"),
            ("softmax", ": that is a softmax over the chosen logits; DeepSeek-V3 normalises "
                        "the chosen sigmoid affinities: s / (sum of the chosen s)"),
            ("raw", ": those are the chosen affinities as they are; normalise them among the "
                    "chosen, so that a token's k weights sum to 1")):
        _, other = loop_biased_route(logits, bias, k, weigh=weigh)
        other = torch.stack([torch.stack(row) for row in other]).detach()
        if other.shape == weights.shape and torch.allclose(weights, other, **TIGHT):
            return hint
    return ""


@pytest.mark.task11_7
@sweep(max_examples=40, tokens=st.integers(1, 10), num_experts=st.integers(1, 8),
       data=st.data(), seed=st.integers(0, 2**16))
def test_biased_route_matches_a_loop(ex, tokens, num_experts, data, seed):
    """biased_route equals a loop over tokens and experts on 40 generated cases (1 to 10 tokens, 1
    to 8 experts, k from 1 to E, biases up to ±1): the experts chosen by sigmoid(logits) + bias,
    largest first, and the weights, the chosen affinities normalised, with their gradient, in
    float64."""
    k = data.draw(st.integers(1, num_experts), label="k")
    logits = (seeded(seed, tokens, num_experts) * 2).requires_grad_(True)
    bias = (torch.rand(num_experts, generator=torch.Generator().manual_seed(seed + 1),
                       dtype=torch.float64) * 2 - 1) * data.draw(st.sampled_from([0, 0.1, 1]),
                                                                  label="bias scale")
    experts, weights = ex.biased_route(logits, bias, k)
    want_experts, want_weights = loop_biased_route(logits, bias, k)
    where = f"biased_route(logits of {tokens} x {num_experts}, bias {bias.tolist()}, k={k})"
    assert tuple(experts.shape) == (tokens, k), f"{where}: experts is {tuple(experts.shape)}"

    def chosen_without_the_bias(got):
        unbiased, _ = loop_biased_route(logits, bias, k, choose_by="s")
        return (": those are the top-k of the affinities alone; choose by s + bias (the bias "
                "exists to steer the choice)") if got == unbiased else ""

    assert_routed_as(
        where, experts, weights, want_experts, want_weights, logits, seeded(seed + 2, tokens, k),
        order="s + bias", experts_hint=chosen_without_the_bias,
        weights_hint=lambda: weights_hint(weights.detach(), logits.detach(), bias, k),
        graph_hint="keep the affinities in the graph (the choice itself needs no gradient)")


@pytest.mark.task11_7
def test_the_bias_moves_the_choice_only(ex):
    """A bias of +1 on expert 2 makes every token of 4 choose it over its own favourite (k = 1,
    4 experts), and each weight stays s / s = 1 for k = 1 and the affinities' own share for
    k = 2: the bias enters the choice, never the weights."""
    logits = torch.tensor([[2.0, 0.0, -1.0, 0.5]] * 4, dtype=torch.float64)
    bias = torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    experts, weights = ex.biased_route(logits, bias, 1)
    assert experts.flatten().tolist() == [2] * 4, (
        f"biased_route(k=1) with a bias of +1 on expert 2 chose {experts.flatten().tolist()}: "
        f"sigmoid(-1) + 1 = 1.27 beats sigmoid(2) = 0.88; choose by s + bias")
    assert_close(weights, torch.ones(4, 1, dtype=torch.float64), "biased_route(k=1): weights",
                 **TIGHT)
    experts, weights = ex.biased_route(logits, bias, 2)
    s = logits[0].sigmoid()
    want = torch.stack([s[2], s[0]]) / (s[2] + s[0])
    assert experts[0].tolist() == [2, 0], f"biased_route(k=2): experts {experts[0].tolist()}"
    try:
        assert_close(weights[0], want, "biased_route(k=2): token 0's weights", **TIGHT)
    except AssertionError as error:
        raise AssertionError(f"{error}{weights_hint(weights, logits, bias, 2)}") from None


@pytest.mark.task11_7
@pytest.mark.parametrize("k, bias_shape", [(0, (3,)), (4, (3,)), (2, (4,)), (2, (1, 3))])
def test_biased_route_refuses(ex, k, bias_shape):
    """biased_route raises a ValueError for k = 0 and 4 with 3 experts, naming k and 3, and for a
    bias shaped (4,) or (1, 3) with 3 experts, naming its shape."""
    with pytest.raises(ValueError) as raised:
        ex.biased_route(seeded(0, 5, 3), torch.zeros(bias_shape, dtype=torch.float64), k)
    said = str(raised.value)
    named = [str(k), "3"] if bias_shape == (3,) else [str(tuple(bias_shape))]
    assert (all(n in said for n in named) if bias_shape == (3,)
            else names_shape(said, bias_shape)), (
        f"biased_route(k={k}, bias {bias_shape}) with 3 experts: the message should name "
        f"{' and '.join(named)}: {raised.value}")


@pytest.mark.task11_7
@sweep(max_examples=40, num_experts=st.integers(1, 8), rate=st.sampled_from([0.0, 1e-3, 0.5]),
       data=st.data(), seed=st.integers(0, 2**16))
def test_update_bias_follows_the_sign_of_the_load_error(ex, num_experts, rate, data, seed):
    """update_bias equals the paper's rule expert by expert on 40 generated cases (1 to 8 experts,
    integer loads, ties at the mean among them, rates 0, 1e-3 and 0.5, float32 and float64):
    down by rate above the mean load, up below it, unchanged at it; a new tensor, bias left as
    it was."""
    generator = torch.Generator().manual_seed(seed)
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64]), label="dtype")
    load = torch.randint(0, 6, (num_experts,), generator=generator)
    if data.draw(st.booleans(), label="an integer mean"):  # 10 + deviations that add up to 0
        deviation = torch.randint(-2, 3, (num_experts,), generator=generator)
        deviation[-1] -= deviation.sum()
        load = 10 + deviation  # the mean is 10 exactly, and some experts have it
    bias = torch.randn(num_experts, generator=generator, dtype=dtype)
    before = bias.clone()
    new = ex.update_bias(bias, load, rate)
    where = f"update_bias(bias, load {load.tolist()}, rate={rate})"
    assert torch.equal(bias, before), f"{where} changed bias itself; return a new tensor"
    assert isinstance(new, torch.Tensor) and new.dtype == dtype, (
        f"{where}: returned {getattr(new, 'dtype', type(new).__name__)}, expected a {dtype} tensor")
    want = torch.tensor(loop_update_bias(before.tolist(), load.tolist(), rate), dtype=dtype)
    tolerance = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else TIGHT
    if not torch.allclose(new, want, **tolerance):
        hint, mean = "", load.double().mean().item()
        for rule, text in (
                ("reversed", ": the signs are reversed: an overloaded expert (load above the "
                             "mean) gets a lower bias, so that fewer tokens choose it"),
                ("proportional", ": that steps by rate x (mean - load), the size of the error; "
                                 "DeepSeek-V3 steps by rate itself, the sign of the error")):
            other = torch.tensor(loop_update_bias(before.tolist(), load.tolist(), rate, rule),
                                 dtype=dtype)
            if torch.allclose(new, other, **tolerance):
                hint = text
        at_mean = (load.double() == mean).nonzero().flatten().tolist()
        if not hint and at_mean and not torch.allclose(new[at_mean], before[at_mean]):
            hint = (f": expert(s) {at_mean} have exactly the mean load ({mean:g}) and must keep "
                    f"their bias; only a load above or below the mean moves it")
        raise AssertionError(f"{where} (mean load {mean:g}): {new.tolist()}, expected "
                             f"{want.tolist()}{hint}")


@pytest.mark.task11_7
@pytest.mark.parametrize("rate, load_shape", [(-0.1, (4,)), (0.1, (3,))])
def test_update_bias_refuses(ex, rate, load_shape):
    """update_bias raises a ValueError naming the rate for a rate of -0.1, and naming the shape for
    a load shaped (3,) with a bias of 4 experts."""
    with pytest.raises(ValueError) as raised:
        ex.update_bias(torch.zeros(4), torch.ones(load_shape), rate)
    named, said = (str(rate) if rate < 0 else "(3,)"), str(raised.value)
    assert named in said if rate < 0 else names_shape(said, load_shape), (
        f"update_bias(rate={rate}, load {load_shape}): the message should name {named}: "
        f"{raised.value}")
