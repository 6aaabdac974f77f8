"""task7_3, the cut: split_gpt cuts the running example between blocks into the most even
stages (embeddings and head counted), which chained are the model and train like it.

    pytest lessons/07_pipeline_parallel -m task7_3
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from gpt import GPT, GPTStage

from harness.compare import assert_close
from harness.exercises import load_exercise, raise_if_untouched
from harness.ranks import run_on_ranks
from lesson07.common import (
    LESSON,
    STEPS,
    assert_trains_like_one_process,
    batch,
    make_gpt,
    next_token_loss,
    train_stage,
)

# The task's contract, clause by clause, and the tests that fail when only that clause is
# broken (tests/test_course.py checks the names).
CLAUSES = {
    "task7_3": {
        "gpt.GPTStage(model, start, end) for each stage, keeping the model's own modules": [
            "test_split_gpt_cuts_between_blocks_as_evenly_as_possible",
            "test_split_gpt_stages_chained_are_the_model",
            "test_split_gpt_stages_train_like_the_unsplit_model"],
        "num_stages stages of consecutive blocks, in order": [
            "test_split_gpt_cuts_between_blocks_as_evenly_as_possible",
            "test_split_gpt_stages_chained_are_the_model"],
        "the first stage's count includes the embeddings, the last's the final norm and head": [
            "test_split_gpt_cuts_between_blocks_as_evenly_as_possible"],
        "of every cut into non-empty runs, one whose largest stage is smallest": [
            "test_split_gpt_cuts_between_blocks_as_evenly_as_possible"],
        "ties: the fewest blocks in the first stage, then the second, and so on": [
            "test_split_gpt_breaks_ties_with_the_fewest_blocks_first"],
        "more stages than blocks raise ValueError naming both numbers": [
            "test_split_gpt_refuses_more_stages_than_blocks"],
    },
}


# 5 blocks, embeddings and head as large as 3 blocks each: 3 stages of 2, 1 and 2 blocks (as
# many blocks in each as can be) leave the middle stage a third as large as the others.
BIG_ENDS = dict(vocab_size=600, n_layer=5)


def stage_sizes(stages) -> list[int]:
    return [sum(p.numel() for p in stage.parameters()) for stage in stages]


def best_largest_stage(model: GPT, num_stages: int) -> int:
    """The smallest possible largest stage, over every cut between blocks."""
    sizes = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    sizes[0] += sum(p.numel() for m in (model.tok_emb, model.pos_emb) for p in m.parameters())
    sizes[-1] += sum(p.numel() for m in (model.ln_f, model.lm_head) for p in m.parameters())
    n = len(sizes)
    return min(max(sum(sizes[a:b]) for a, b in itertools.pairwise((0, *cuts, n)))
               for cuts in itertools.combinations(range(1, n), num_stages - 1))


@pytest.mark.task7_3
@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 5])
def test_split_gpt_cuts_between_blocks_as_evenly_as_possible(ex, num_stages):
    """split_gpt's gpt.GPTStage modules hold every parameter of the model once, in order
    (embeddings first, head last), and their largest parameter count is the smallest of every
    cut: 1 to 5 stages of a 5-block model whose embeddings and head weigh as much as three
    blocks each."""
    model = make_gpt(**BIG_ENDS)
    stages = ex.split_gpt(model, num_stages)
    assert len(stages) == num_stages, f"split_gpt(model, {num_stages}) gave {len(stages)} stages"
    # Every parameter of the model, once, in order: the stages hold the model's own modules.
    held = [p for stage in stages for p in stage.parameters()]
    ids = [id(p) for p in held]
    own = {id(p): name for name, p in model.named_parameters()}
    strangers = [i for i in ids if i not in own]
    assert not strangers, (
        f"{len(strangers)} of the stages' parameters are not the model's own: keep its "
        f"modules (model.blocks[i], model.tok_emb, ...), do not copy them")
    assert sorted(ids) == sorted(own) and len(set(ids)) == len(ids), (
        f"the stages hold {len(set(ids))} of the model's {len(own)} parameters, "
        f"{len(ids) - len(set(ids))} twice: every parameter belongs to exactly one stage")
    order = [own[i] for i in ids]
    blocks = [int(name.split(".")[1]) for name in order if name.startswith("blocks.")]
    assert blocks == sorted(blocks), f"the blocks are not in order across the stages: {blocks}"
    assert order[0].startswith("tok_emb") or order[0].startswith("pos_emb"), (
        f"the first stage should hold the embeddings first, not {order[0]!r}")
    assert "lm_head.weight" in {own[id(p)] for p in stages[-1].parameters()}, (
        "the last stage should hold the head")
    assert all(isinstance(stage, GPTStage) for stage in stages), (
        f"split_gpt should return gpt.GPTStage modules, not {type(stages[0]).__name__}")
    largest, best = max(stage_sizes(stages)), best_largest_stage(model, num_stages)
    assert largest == best, (
        f"split_gpt(model, {num_stages}): stages of {stage_sizes(stages)} parameters; the "
        f"largest is {largest:,} but a cut with {best:,} exists. Count the embeddings with "
        f"the first block and the final norm and head with the last, then take the cut whose "
        f"largest stage is smallest (not the one with as many blocks in each)")


def blocks_per_stage(model: GPT, stages) -> list[int]:
    own = {id(p): name for name, p in model.named_parameters()}
    return [len({own[id(p)].split(".")[1] for p in stage.parameters()
                 if own.get(id(p), "").startswith("blocks.")}) for stage in stages]


@pytest.mark.task7_3
@pytest.mark.parametrize(("n_layer", "num_stages"), [(5, 4), (6, 4), (6, 5)])
def test_split_gpt_breaks_ties_with_the_fewest_blocks_first(ex, n_layer, num_stages):
    """Of the cuts with the smallest largest stage, split_gpt takes the first in
    itertools.combinations order (the fewest blocks in the first stage, then the second, ...): 5
    blocks in 4 stages and 6 blocks in 4 and 5, against every cut."""
    model = make_gpt(**{**BIG_ENDS, "n_layer": n_layer})
    sizes = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    best = best_largest_stage(model, num_stages)
    tied = []
    for cuts in itertools.combinations(range(1, n_layer), num_stages - 1):
        lengths = [b - a for a, b in itertools.pairwise((0, *cuts, n_layer))]
        stages = [GPTStage(model, a, b) for a, b in itertools.pairwise((0, *cuts, n_layer))]
        if max(stage_sizes(stages)) == best:
            tied.append(lengths)
    assert len(tied) > 1, f"the test's model has one best cut, {tied}, not a tie ({sizes})"
    got = blocks_per_stage(model, ex.split_gpt(model, num_stages))
    assert got == tied[0], (
        f"split_gpt(model, {num_stages}) on {n_layer} blocks: stages of {got} blocks; the cuts "
        f"of {' and of '.join(map(str, tied))} blocks all have the smallest largest stage "
        f"({best:,} parameters). Of tied cuts take the one with the fewest blocks in the first "
        f"stage, then in the second, and so on, {tied[0]}: keep the first best cut found in "
        f"itertools.combinations order, replace it only by a strictly smaller largest stage")


@pytest.mark.task7_3
@pytest.mark.parametrize("num_stages", [2, 4])
def test_split_gpt_stages_chained_are_the_model(ex, num_stages):
    """split_gpt's 2 and 4 stages, chained in one process, give the 5-block model's logits and
    every parameter's gradient, against an unsplit copy."""
    model = make_gpt(**BIG_ENDS)
    reference = copy.deepcopy(model)
    stages = ex.split_gpt(model, num_stages)
    inputs, targets = batch(0)
    x = inputs
    for stage in stages:
        x = stage(x)
    logits, loss = reference(inputs, targets)
    assert_close(x, logits, f"{num_stages} stages chained: the logits")
    next_token_loss(x, targets).backward()
    loss.backward()
    want = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name!r} got no gradient through the chained stages"
        assert_close(p.grad, want[name].grad, f"the gradient of {name!r} through the stages")


def split_gpt_pipeline_run(ctx, m: int, steps: int):
    """This rank's stage of ``split_gpt``'s cut, trained through torch's 1F1B schedule (the
    tests' own pipeline, not the learner's runner or task7_4's answer)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    ex = load_exercise(LESSON)
    model = make_gpt()
    stage = ex.split_gpt(model, ctx.world_size)[ctx.rank]
    schedule = Schedule1F1B(PipelineStage(stage, ctx.rank, ctx.world_size, ctx.device),
                            n_microbatches=m, loss_fn=next_token_loss)
    first, last = ctx.rank == 0, ctx.rank == ctx.world_size - 1

    def one_step(step: int) -> list[float]:
        inputs, targets = batch(step)
        losses: list[torch.Tensor] = []
        schedule.step(*([inputs] if first else []),
                      **({"target": targets, "losses": losses} if last else {}))
        return [loss.item() for loss in losses]

    return train_stage(model, stage, one_step, steps)


@pytest.mark.task7_3
def test_split_gpt_stages_train_like_the_unsplit_model(ex):
    """split_gpt's 2 stages, one per gloo rank, trained through torch's Schedule1F1B with 4
    micro-batches, take the unsplit model's steps: gradients and parameters after each of 2 SGD
    steps against one process."""
    raise_if_untouched(ex.split_gpt)
    results = run_on_ranks(split_gpt_pipeline_run, 4, STEPS, world_size=2, timeout=60)
    assert_trains_like_one_process(results, "split_gpt's 2 stages, 1F1B, 4 micro-batches", 4)


@pytest.mark.task7_3
def test_split_gpt_refuses_more_stages_than_blocks(ex):
    """split_gpt raises ValueError naming both numbers for 5 stages of a 4-block model."""
    try:
        ex.split_gpt(make_gpt(), 5)
    except ValueError as error:
        assert "4" in str(error) and "5" in str(error), (
            f"the error should name the 4 blocks and the 5 stages: {error}")
        return
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the wrong kind of error is the finding
        raise AssertionError(f"split_gpt(model of 4 blocks, 5) raised {type(error).__name__}: "
                             f"{error}; check first and raise ValueError naming the 4 blocks "
                             f"and the 5 stages") from None
    raise AssertionError("split_gpt(model of 4 blocks, 5) should raise ValueError")


