"""Grades task5_10, zero_peak_bytes: a step's peak per rank under the lesson's ZeRO-1 and ZeRO-2,
checked to the byte against the text's sum on generated sizes, then against the peak measured
on 2 gloo ranks, with and without checkpointing.

    pytest lessons/05_sharded_data_parallel -m task5_10
"""

from __future__ import annotations

import pytest
from gpt import GPT, GPTConfig

from harness.exercises import raise_if_untouched
from harness.sweep import st, sweep
from lesson05.common import (
    ACTIVATIONS,
    LOSS,
    NO_BIAS,
    STATE,
    assert_near_the_measured_peaks,
    assert_refuses,
    kept_by_autograd,
)

# This task's contract, clause by clause, and the tests that fail when only that clause
# is broken (tests/test_course.py checks the names).
CLAUSES = {
    "task5_10": {
        "held: memory_per_rank's parameters and optimizer state, no gradient between steps": [
            "test_zero_peak_bytes_is_the_texts_sum_for_any_size",
            "test_zero_peak_bytes_predicts_the_measured_peak"],
        "the larger of the backward's two ends: every activation, or every gradient (G)": [
            "test_zero_peak_bytes_is_the_texts_sum_for_any_size",
            "test_zero_peak_bytes_predicts_the_measured_peak"],
        "G is memory_per_rank's gradients: whole under ZeRO-1, this rank's pieces under ZeRO-2": [
            "test_zero_peak_bytes_is_the_texts_sum_for_any_size",
            "test_zero_peak_bytes_predicts_the_measured_peak"],
        "the activations of this rank's batch_size // world_size sequences": [
            "test_zero_peak_bytes_is_the_texts_sum_for_any_size",
            "test_zero_peak_bytes_predicts_the_measured_peak"],
        "R: the largest parameter padded and two pieces, (W + 2)·⌈P/W⌉; under ZeRO-2 its whole "
        "gradient too, at the start as well; beside the logits, R + NV": [
            "test_zero_peak_bytes_is_the_texts_sum_for_any_size",
            "test_zero_peak_bytes_whichever_parameter_is_largest"],
        "P is the largest parameter: an MLP weight, the token embedding and head, or the "
        "position embedding": ["test_zero_peak_bytes_whichever_parameter_is_largest"],
        "the loss's backward at the start; with checkpoint=True the recomputed block at both ends":
            ["test_zero_peak_bytes_is_the_texts_sum_for_any_size",
             "test_zero_peak_bytes_predicts_the_measured_peak"],
        "defaults: one rank, ZeRO-1, no checkpointing": [
            "test_zero_peak_bytes_is_the_texts_sum_for_any_size"],
        "a stage other than 1 or 2, world_size below 1, or an uneven split raises ValueError "
        "(and what activation_bytes refuses)": [
            "test_zero_peak_bytes_refuses_what_it_does_not_predict"],
    },
}

TOLERANCE = 0.15  # the reference: 0.91 to 1.04 times the measured peak (see the README)


def predict(ex, config: GPTConfig, batch_size: int, world: int, stage: int,
            checkpoint: bool) -> int:
    """``zero_peak_bytes``, the defaults (one rank, ZeRO-1, no checkpointing) left out where
    they hold."""
    arguments = {name: value for name, value, default in (
        ("world_size", world, 1), ("stage", stage, 1), ("checkpoint", checkpoint, False))
        if value != default}
    return ex.zero_peak_bytes(config, batch_size, **arguments)


def texts_sum(config: GPTConfig, share: int, world: int, stage: int, checkpoint: bool, *,
              whole_gradients_held: bool = False, start_only: bool = False,
              whole_gradient_in_r: bool | None = None, padded_copy: bool = True,
              pieces_at_the_end: bool | None = None, recompute_at_the_end: bool = True,
              whole_batch: bool = False, logits_beside_r: bool = True, largest=None) -> int:
    """The oracle, written from the text (Ψ and P counted by torch, the activations by its
    saved-tensors hook); each keyword does one part another way, for naming a mistake."""
    model = GPT(config)
    psi = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters()) if largest is None else largest
    tokens = share * config.block_size
    C, H, V = config.n_embd, config.n_head, config.vocab_size
    piece = -(-largest // world)
    whole_gradient_in_r = stage == 2 if whole_gradient_in_r is None else whole_gradient_in_r
    pieces_at_the_end = stage == 2 if pieces_at_the_end is None else pieces_at_the_end
    held = 4 * psi + 8 * -(-psi // world)
    gradients = 4 * (-(-psi // world) if pieces_at_the_end else psi)
    r = (world + 2 if padded_copy else 2) * piece + (largest if whole_gradient_in_r else 0)
    r += tokens * V if logits_beside_r else 0  # the logits, held by the caller
    recompute = tokens * (16 * C + H + 4 + V) if checkpoint else 0
    activations = kept_by_autograd(config, share * (world if whole_batch else 1), checkpoint)
    start = activations + 4 * max(3 * tokens * V, recompute, r if stage == 2 else 0)
    end = gradients + 4 * max(r, recompute if recompute_at_the_end else 0)
    if whole_gradients_held:  # memory_per_rank's whole total, held through the step
        return held + gradients + start
    return held + (start if start_only else max(start, end))


MISTAKES = (  # (the keywords that make the mistake, what it is)
    (dict(whole_gradients_held=True),
     "the gradients held through the whole step: these optimizers free them in step(), so "
     "the backward trades activations for gradients and the peak comes near one end"),
    (dict(start_only=True),
     "only the backward's start: at its end the rank holds every gradient G and R"),
    (dict(whole_gradient_in_r=False),
     "R without the whole gradient: ZeRO-2 reduce-scatters inside the backward, beside it"),
    (dict(whole_gradient_in_r=True),
     "R with the whole gradient under ZeRO-1: the gradient being reduced is one of G's, "
     "already counted"),
    (dict(padded_copy=False),
     "R without the padded copy: reduce_scatter_mean pads the gradient to W pieces first"),
    (dict(pieces_at_the_end=False),
     "ZeRO-2's G whole: its hooks keep only this rank's pieces"),
    (dict(pieces_at_the_end=True),
     "ZeRO-1's G in pieces: its gradients stay whole until step()"),
    (dict(recompute_at_the_end=False),
     "no recomputed block at the end: the first block is recomputed last, beside nearly "
     "every gradient"),
    (dict(whole_batch=True),
     "the activations of the whole batch: a rank's batch is batch_size // world_size"),
    (dict(logits_beside_r=False),
     "R alone: the caller holds the logits through the step, NV beside it"),
)


def diagnosis(got, config: GPTConfig, share: int, world: int, stage: int,
              checkpoint: bool) -> str:
    """Name the mistake where the answer is the text's sum with one part done another way."""
    want = texts_sum(config, share, world, stage, checkpoint)
    C, V, T = config.n_embd, config.vocab_size, config.block_size
    mistakes = [*MISTAKES, (dict(largest=4 * C * C),
                            "P as an MLP weight: P is the largest parameter, max(4C², VC, TC)")]
    mistakes += [(dict(largest=max(4 * C * C, V * C)),
                  "P without the position embedding: P is max(4C², VC, TC)")] * (T > 4 * C)
    found = [why for keywords, why in mistakes
             if got == texts_sum(config, share, world, stage, checkpoint, **keywords) != want]
    if found:  # several where sizes coincide: each is named
        return ". It is the sum with " + "; or with ".join(found)
    return " (Ψ and P as GPT(config) has them, biases or not)"


@pytest.mark.task5_10
@sweep(max_examples=30, shrink=False, heads=st.integers(1, 4), head_dim=st.integers(1, 8),
       layers=st.integers(1, 3), length=st.integers(1, 16), share=st.integers(1, 3),
       world=st.integers(1, 4), vocab=st.integers(2, 70), bias=st.booleans(),
       stage=st.sampled_from([1, 2]), checkpoint=st.booleans())
def test_zero_peak_bytes_is_the_texts_sum_for_any_size(ex, heads, head_dim, layers, length,
                                                       share, world, vocab, bias, stage,
                                                       checkpoint):
    """`zero_peak_bytes` is the text's sum to the byte for generated sizes on 1 to 4 ranks,
    ZeRO-1 and ZeRO-2, with and without checkpointing (Ψ and P counted by torch, the activations
    by its saved-tensors hook).

    The measured test shows the sum is the peak, within its tolerance; this one that the sum is
    the one the text adds up."""
    config = GPTConfig(vocab_size=vocab, block_size=length, n_layer=layers, n_head=heads,
                       n_embd=heads * head_dim, bias=bias)
    got = predict(ex, config, share * world, world, stage, checkpoint)
    want = texts_sum(config, share, world, stage, checkpoint)
    assert got == want, (
        f"zero_peak_bytes({config}, batch_size={share * world}, world_size={world}, "
        f"stage={stage}, checkpoint={checkpoint}) = {got!r}; the text's sum is {want:,}"
        + diagnosis(got, config, share, world, stage, checkpoint))


@pytest.mark.task5_10
@pytest.mark.parametrize("largest, sizes", [
    ("an MLP weight", dict(vocab_size=30, block_size=8, n_embd=16)),
    ("the token embedding and the head", dict(vocab_size=200, block_size=8, n_embd=16)),
    ("the position embedding", dict(vocab_size=2, block_size=64, n_embd=4))],
    ids=["mlp", "embedding", "positions"])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_peak_bytes_whichever_parameter_is_largest(ex, largest, sizes, stage):
    """`zero_peak_bytes` is the text's sum to the byte where an MLP weight, the token embedding
    and head, or the position embedding is the largest parameter, on 3 ranks, ZeRO-1 and ZeRO-2,
    with and without checkpointing.

    These are sizes where R, the reduce-scatter of the largest, is the moment that counts
    without checkpointing (for the position embedding only under ZeRO-2, at the start: the
    vocabulary is 2)."""
    config = GPTConfig(**sizes, n_layer=1, n_head=2)
    for checkpoint in (False, True):
        got = predict(ex, config, 3, 3, stage, checkpoint)
        want = texts_sum(config, 1, 3, stage, checkpoint)
        assert got == want, (
            f"zero_peak_bytes({config}, batch_size=3, world_size=3, stage={stage}, "
            f"checkpoint={checkpoint}) = {got!r}; the text's sum is {want:,}, with P the "
            f"largest parameter, {largest} here"
            + diagnosis(got, config, 1, 3, stage, checkpoint))


# (configuration, sequences in all, checkpointed or not), on 2 ranks: where the backward's
# start is the peak (LOSS: the activations and the loss's backward), where its end is (STATE:
# the gradients; ACTIVATIONS checkpointed, under ZeRO-1: the gradients and the recomputed
# block), and where each end wins under one stage (NO_BIAS).
CASES = [(ACTIVATIONS, 8, True), (STATE, 4, False), (LOSS, 4, False), (LOSS, 4, True),
         (NO_BIAS, 6, False), (NO_BIAS, 6, True)]
WORLD = 2


@pytest.mark.task5_10
def test_zero_peak_bytes_predicts_the_measured_peak(ex):
    """`zero_peak_bytes` comes within 15 % of the peak measured on 2 gloo ranks (the state held,
    plus `AllocationPeak` over a step) with the reference answers' `Zero1Optimizer` and
    `Zero2Optimizer`: 12 cases, four configurations where the backward's start or its end tops
    the peak (two of them with and without checkpointing)."""
    raise_if_untouched(ex.zero_peak_bytes, ex.activation_bytes)
    cases = [(config, batch, stage, checkpoint, False) for config, batch, checkpoint in CASES
             for stage in (1, 2)]
    predicted = [predict(ex, GPTConfig(**config), batch, WORLD, stage, checkpoint)
                 for config, batch, stage, checkpoint, _ in cases]
    assert_near_the_measured_peaks(
        "zero_peak_bytes", cases, predicted, WORLD, TOLERANCE,
        "no gradient is held between steps; the peak is the larger of the backward's start, "
        "every activation, and its end, every gradient: whole under ZeRO-1, pieces under ZeRO-2")


@pytest.mark.task5_10
@pytest.mark.parametrize("arguments", [
    dict(stage=0), dict(stage=3), dict(stage=-1), dict(world_size=0), dict(world_size=-2),
    dict(world_size=3), dict(world_size=1, batch_size=0), dict(dropout=0.1)],
    ids=["stage0", "stage3", "negative-stage", "no-rank", "negative-ranks", "uneven",
         "no-sequence", "dropout"])
def test_zero_peak_bytes_refuses_what_it_does_not_predict(ex, arguments):
    """Stages 0, 3 and -1, a world of 0 or -2 ranks, 16 sequences over 3 ranks, no sequence and
    dropout 0.1 each raise ValueError."""
    assert_refuses(ex.zero_peak_bytes, arguments, 1, "ZeRO-1 (stage 1) and ZeRO-2 (stage 2)")
