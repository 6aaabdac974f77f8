"""Lesson 10, task10_7: token_mean_loss, the cross-entropy averaged over every rank's real tokens
(not the mean of the ranks' means), against F.cross_entropy on the whole batch in one process,
on 2 and 3 gloo ranks with uneven counts of real tokens, under DDP, and in a subgroup.

    pytest lessons/10_long_sequences -m task10_7
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from harness.compare import assert_close
from harness.exercises import load_exercise, raise_if_untouched
from harness.ranks import run_on_ranks
from harness.sweep import st, sweep
from lesson10.common import LESSON, TIGHT, as_one_failure, seeded

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task10_7": {
        "the value: the sum over every rank's real tokens divided by their number, on every "
        "rank": ["test_token_mean_loss_is_the_mean_over_every_ranks_real_tokens"],
        "a target equal to ignore_index is not a token (any ignore_index)":
            ["test_token_mean_loss_is_the_mean_over_every_ranks_real_tokens"],
        "the gradients, summed over the ranks, are one process's":
            ["test_token_mean_loss_is_the_mean_over_every_ranks_real_tokens"],
        "a rank with no real token: no NaN": [
            "test_token_mean_loss_is_finite_on_a_rank_without_real_tokens"],
        "no real token anywhere: 0, and zero gradients": [
            "test_token_mean_loss_is_zero_when_no_rank_has_a_real_token"],
        "under DDP, (W * loss).backward() gives one process's gradients":
            ["test_token_mean_loss_times_w_under_ddp_is_one_process"],
        "within group only": ["test_token_mean_loss_stays_within_its_group"],
    },
}

VOCAB, FEATURES = 5, 3


def batch_of(rank: int, tokens: int, real: int, ignore_index: int):
    """Rank ``rank``'s features (tokens, FEATURES) and targets (tokens,): ``real`` real targets,
    spread out from a seed, the others ``ignore_index``. A real target is never ignore_index."""
    features = seeded(300 + rank, tokens, FEATURES)
    classes = [c for c in range(VOCAB) if c != ignore_index]
    picks = torch.randint(len(classes), (tokens,), generator=torch.Generator().manual_seed(rank))
    targets = torch.tensor(classes)[picks]
    keep = torch.randperm(tokens, generator=torch.Generator().manual_seed(50 + rank))[:real]
    ignored = torch.ones(tokens, dtype=torch.bool)
    ignored[keep] = False
    return features, targets.masked_fill(ignored, ignore_index)


def weight() -> torch.Tensor:
    return seeded(7, FEATURES, VOCAB)


def loss_run(ctx, counts, ignore_index, tokens: int, groups=None, ddp: bool = False):
    """This rank's token_mean_loss of logits = features @ weight (weight shared by every rank)
    and its gradients; with ``ddp``, the same through DDP with (W * loss).backward()."""
    ex = load_exercise(LESSON)
    group, members = None, list(range(ctx.world_size))
    for ranks in groups or ():
        made = dist.new_group(ranks)
        if ctx.rank in ranks:
            group, members = made, ranks
    features, targets = batch_of(ctx.rank, tokens, counts[ctx.rank], ignore_index)
    if ddp:
        model = torch.nn.Linear(FEATURES, VOCAB, bias=False, dtype=torch.float64)
        with torch.no_grad():
            model.weight.copy_(weight().T)
        wrapped = DDP(model)
        loss = ex.token_mean_loss(wrapped(features), targets, ignore_index)
        (ctx.world_size * loss).backward()
        return {"value": loss.detach(), "weight_grad": model.weight.grad.T}
    shared = weight().requires_grad_(True)
    logits = features @ shared
    logits.retain_grad()
    if ignore_index == -100:  # the default
        loss = ex.token_mean_loss(logits, targets, group=group)
    else:
        loss = ex.token_mean_loss(logits, targets, ignore_index, group)
    loss.backward()
    return {"value": loss.detach(), "logits_grad": logits.grad, "weight_grad": shared.grad,
            "members": members}


def one_process(ranks, counts, ignore_index, tokens: int):
    """F.cross_entropy over the ranks' tokens together: the value, each rank's logits'
    gradient, the shared weight's."""
    pairs = [batch_of(r, tokens, counts[r], ignore_index) for r in ranks]
    shared = weight().requires_grad_(True)
    logits = torch.cat([features for features, _ in pairs]) @ shared
    logits.retain_grad()
    loss = F.cross_entropy(logits, torch.cat([t for _, t in pairs]), ignore_index=ignore_index)
    loss.backward()
    return loss.detach(), list(logits.grad.split(tokens)), shared.grad


def diagnose_value(value: float, rank: int, counts: list[int], ignore_index: int, tokens: int,
                   ranks: list[int]) -> str:
    """Name the mistake when the value is exactly what a known one gives."""
    pairs = [batch_of(r, tokens, counts[r], ignore_index) for r in ranks]
    logits = [features @ weight() for features, _ in pairs]
    sums = [F.cross_entropy(lg, t, ignore_index=ignore_index, reduction="sum")
            for lg, (_, t) in zip(logits, pairs, strict=True)]
    real = sum(counts[r] for r in ranks)
    guesses = {
        "the mean of the ranks' means: each rank's mean weighs its tokens by 1 / its own count; "
        "add up the sums and the counts, then divide":
            sum(s / max(counts[r], 1) for s, r in zip(sums, ranks, strict=True)) / len(ranks),
        "this rank's own mean, divided by its own count of real tokens: add up every rank's "
        "sum and count first": sums[ranks.index(rank)] / max(counts[rank], 1),
        "divided by every token, ignored ones included: count only the targets that are not "
        "ignore_index": sum(sums) / (tokens * len(ranks)),
    }
    right = float(sum(sums)) / real if real else 0.0
    matches = [why for why, guess in guesses.items()
               if abs(float(guess) - value) < 1e-9 and abs(float(guess) - right) > 1e-6]
    return f": that is {', or '.join(matches)}" if matches else ""


def check_mean(results, world: int, tokens: int, counts: list[int], ignore_index: int) -> None:
    value, logits_grads, weight_grad = one_process(range(world), counts, ignore_index, tokens)
    case = (f"({world} ranks of {tokens} tokens, real tokens per rank {counts}, ignore_index="
            f"{ignore_index})")
    for rank, got in enumerate(results):
        assert got["value"].shape == (), (
            f"rank {rank}: token_mean_loss returned shape {tuple(got['value'].shape)}: a scalar")
        assert torch.isfinite(got["value"]), (
            f"rank {rank}: token_mean_loss is {float(got['value'])} {case}"
            + (": NaN or inf where a rank has no real token; a mean over no token is 0/0. Add "
               "up the losses (reduction='sum') and the counts, then divide once"
               if 0 in counts else ""))
        why = diagnose_value(float(got["value"]), rank, counts, ignore_index, tokens,
                             list(range(world)))
        try:
            assert_close(got["value"], value, f"token_mean_loss {case}: the mean over every "
                         f"rank's real tokens, the same on every rank", rank, **TIGHT)
        except AssertionError as error:
            raise AssertionError(f"{error}{why}") from None
        expected = logits_grads[rank]
        why = ""
        local = counts[rank]
        if local and torch.allclose(got["logits_grad"] * local / sum(counts), expected,
                                    rtol=1e-9, atol=1e-12) and local != sum(counts):
            why = (f": {sum(counts)} / {local} times too large: the gradient was divided by "
                   f"this rank's {local} real tokens, not by all ranks' {sum(counts)}")
        try:
            assert_close(got["logits_grad"], expected, f"the gradient of rank {rank}'s logits "
                         f"through token_mean_loss {case}", rank, **TIGHT)
        except AssertionError as error:
            raise AssertionError(f"{error}{why}") from None
    assert_close(sum(got["weight_grad"] for got in results), weight_grad,
                 f"the shared weight's gradient through token_mean_loss, summed over the ranks "
                 f"{case}: one process's")


@pytest.mark.task10_7
@sweep(max_examples=12, world=st.sampled_from([2, 3]), tokens=st.integers(1, 5),
       shares=st.lists(st.floats(0, 1), min_size=3, max_size=3),
       ignore_index=st.sampled_from([-100, 0]))
def test_token_mean_loss_is_the_mean_over_every_ranks_real_tokens(ex, world, tokens, shares,
                                                                  ignore_index):
    """token_mean_loss is, on every rank, F.cross_entropy over all ranks' tokens in one process,
    and each rank's logits get that process's gradient, the shared weight's summed over ranks: on 2
    and 3 gloo ranks, 12 generated cases of 1-5 tokens a rank, uneven real counts, ignore_index -100
    and 0."""
    raise_if_untouched(ex.token_mean_loss)
    counts = [round(share * tokens) for share in shares[:world]]
    if not sum(counts):
        counts[0] = 1  # at least one real token: one process's mean is NaN otherwise
    results = run_on_ranks(loss_run, counts, ignore_index, tokens, world_size=world)
    as_one_failure(check_mean, results, world, tokens, counts, ignore_index)



@pytest.mark.task10_7
@pytest.mark.parametrize("world", [2, 3])
def test_token_mean_loss_is_finite_on_a_rank_without_real_tokens(ex, world):
    """With rank 1's 4 tokens all ignored, token_mean_loss and every gradient are finite on every
    rank and equal one process's, on 2 and 3 gloo ranks."""
    raise_if_untouched(ex.token_mean_loss)
    counts = [3, 0, 2][:world]
    results = run_on_ranks(loss_run, counts, -100, 4, world_size=world)
    value, logits_grads, _ = one_process(range(world), counts, -100, 4)
    for rank, got in enumerate(results):
        for name in ("value", "logits_grad", "weight_grad"):
            assert torch.isfinite(got[name]).all(), (
                f"rank {rank}: token_mean_loss's {name.replace('_', ' ')} has NaN or inf with "
                f"real tokens per rank {counts} (rank 1 has none): a mean over no token is 0/0. "
                f"Add up the losses (reduction='sum') and the counts, then divide once")
        assert_close(got["value"], value, f"token_mean_loss with real tokens per rank {counts}",
                     rank, **TIGHT)
        assert_close(got["logits_grad"], logits_grads[rank], f"the gradient of rank {rank}'s "
                     f"logits with real tokens per rank {counts}", rank, **TIGHT)


@pytest.mark.task10_7
def test_token_mean_loss_is_zero_when_no_rank_has_a_real_token(ex):
    """With every target of 2 gloo ranks ignored, token_mean_loss is 0 on both, and its gradients
    are zeros (one process's F.cross_entropy gives NaN there)."""
    raise_if_untouched(ex.token_mean_loss)
    features, targets = batch_of(0, 3, 0, -100)
    assert torch.isnan(F.cross_entropy(features @ weight(), targets)), "the text's 0/0"
    for rank, got in enumerate(run_on_ranks(loss_run, [0, 0], -100, 3, world_size=2)):
        assert float(got["value"]) == 0.0, (
            f"rank {rank}: token_mean_loss is {float(got['value'])} when no rank has a real "
            f"token: it should be 0 (divide by the count, at least 1)")
        assert torch.equal(got["logits_grad"], torch.zeros_like(got["logits_grad"])), (
            f"rank {rank}: the logits' gradient should be zeros when no rank has a real token, "
            f"not {got['logits_grad'].flatten()[:4].tolist()}...")


@pytest.mark.task10_7
@pytest.mark.parametrize("world", [2, 3])
def test_token_mean_loss_times_w_under_ddp_is_one_process(ex, world):
    """Under DDP, (W * token_mean_loss).backward() gives every rank the weight gradient of one
    process's F.cross_entropy over all ranks' tokens: a linear layer on 2 and 3 gloo ranks, real
    tokens per rank 4, 1 and 0 of 5."""
    raise_if_untouched(ex.token_mean_loss)
    counts = [4, 1, 0][:world]
    results = run_on_ranks(loss_run, counts, -100, 5, None, True, world_size=world)
    value, _, weight_grad = one_process(range(world), counts, -100, 5)
    for rank, got in enumerate(results):
        assert_close(got["value"], value, f"token_mean_loss under DDP, real tokens per rank "
                     f"{counts}", rank, **TIGHT)
        assert_close(got["weight_grad"], weight_grad, f"the weight's gradient under DDP after "
                     f"(W * token_mean_loss).backward(), real tokens per rank {counts}: one "
                     f"process's (DDP averages the ranks' gradients; their sum is the one)",
                     rank, **TIGHT)


@pytest.mark.task10_7
def test_token_mean_loss_stays_within_its_group(ex):
    """token_mean_loss with `group=` averages over that group's real tokens only: on 3 gloo ranks in
    groups [0, 2] and [1], with 2, 5 and 1 real tokens of 5, value and logits' gradients against one
    process on the group's tokens."""
    raise_if_untouched(ex.token_mean_loss)
    counts = [2, 5, 1]
    results = run_on_ranks(loss_run, counts, -100, 5, [[0, 2], [1]], world_size=3)
    for rank, got in enumerate(results):
        members = got["members"]
        value, logits_grads, _ = one_process(members, counts, -100, 5)
        what = f"with group={members} (real tokens per rank {counts})"
        assert_close(got["value"], value, f"token_mean_loss {what}: the mean over the group's "
                     f"real tokens; pass group= to the all-reduce", rank, **TIGHT)
        assert_close(got["logits_grad"], logits_grads[members.index(rank)],
                     f"the gradient of rank {rank}'s logits {what}", rank, **TIGHT)
