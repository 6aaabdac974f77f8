"""Lesson 07: pipeline parallelism. One process per stage, schedules by hand, then
torch.distributed.pipelining.

What the lesson rests on, checked on gloo/CPU ranks (and on CUDA where present):
- a schedule is right when the lesson's simulator (``simulator.py``) runs it without a
  deadlock, with the bubble and the activations in flight the text gives;
- every stage of a pipeline takes the steps the unsplit model takes on the whole batch;
- a mismatched pair of schedules ends with an error naming the stage, not a hang;
- what a stage posts (its sends and receives, alone or batched) is an order NCCL can run;
- the idle time measured on every stage matches the bubble formula when the stages are even.

The reference is one process on the whole batch, with SGD: a gradient m times too large (or
1/m) moves the weights m times too far, where Adam would normalise the mistake away.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import inspect
import itertools
import re
import time
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.distributed.pipelining  # noqa: F401 - imported here once, so that forked ranks have it
import torch.nn.functional as F
from gpt import GPT, GPTConfig, GPTStage
from torch import nn

from harness.compare import assert_close
from harness.exercises import load_exercise, load_lesson_module, raise_if_untouched
from harness.hardware import needs_gpus
from harness.launch import one_process_fit, run_script, start_first, start_script
from harness.ranks import RankError, get_pool, group_params, run_on_ranks
from harness.sweep import st, sweep
from lesson07.simulator import (
    Deadlock,
    Op,
    OrderMismatch,
    ScheduleError,
    UnsafeOrder,
    check_links,
    reference_schedule,
    simulate,
)

LESSON = "07_pipeline_parallel"
SCRIPT = f"lessons/{LESSON}/train_pp.py"
# 4 blocks: 2 stages of 2 blocks, or 4 of 1. Biases on: SGD steps on them as on the rest.
CONFIG = dict(vocab_size=29, block_size=8, n_layer=4, n_head=2, n_embd=16, bias=True)
BATCH = 8  # sequences per step: 1, 2, 4 or 8 micro-batches
STEPS = 2
SGD = {"lr": 0.5}
# gloo with CPU tensors; on GPUs nccl, one rank per GPU (gloo's send and receive of CUDA tensors
# is not something the course has run).
GROUPS = group_params(world_sizes=(2, 4), cuda_world_sizes=(), nccl_world_sizes=(2, 4))

# Each task's contract, clause by clause, and the tests that fail when only that clause is
# broken (tests/test_course.py checks the names).
CLAUSES = {
    "task7_1": {
        "result[s] is stage s's list of actions, in the order it runs them": [
            "test_schedule_runs_without_deadlock_with_the_bubble_and_memory_of_the_text",
            "test_schedule_of_any_shape_is_the_texts"],
        "gpipe: every forward, micro-batches 0 to m - 1, then every backward": [
            "test_schedule_runs_without_deadlock_with_the_bubble_and_memory_of_the_text",
            "test_schedule_of_any_shape_is_the_texts"],
        "gpipe: the backwards last micro-batch first, the reverse of the forwards": [
            "test_schedule_of_any_shape_is_the_texts"],
        "1f1b: stage s first runs min(p - s - 1, m) forwards (the warm-up)": [
            "test_schedule_runs_without_deadlock_with_the_bubble_and_memory_of_the_text",
            "test_schedule_of_any_shape_is_the_texts"],
        "1f1b: then one forward and one backward, oldest first, then the remaining backwards": [
            "test_schedule_runs_without_deadlock_with_the_bubble_and_memory_of_the_text",
            "test_schedule_of_any_shape_is_the_texts"],
        "each stage runs each micro-batch's forward and backward exactly once": [
            "test_schedule_runs_without_deadlock_with_the_bubble_and_memory_of_the_text",
            "test_schedule_of_any_shape_is_the_texts"],
        "an unknown kind raises ValueError": ["test_schedule_rejects_what_is_not_a_pipeline"],
        "fewer than 1 stage raises ValueError": ["test_schedule_rejects_what_is_not_a_pipeline"],
        "fewer than 1 micro-batch raises ValueError": [
            "test_schedule_rejects_what_is_not_a_pipeline"],
    },
    "task7_2": {
        "F on the first stage: the input is inputs[i]": [
            "test_stage_runner_trains_like_one_process"],
        "F elsewhere: received from stage - 1 into a new tensor of activation_shape": [
            "test_stage_runner_trains_like_one_process"],
        "F elsewhere: the received input is marked requires_grad": [
            "test_stage_runner_trains_like_one_process"],
        "F: run the module, keep the input and the output for the backward": [
            "test_stage_runner_trains_like_one_process"],
        "F on the last stage: loss_fn(output, targets[i]) / m": [
            "test_stage_runner_trains_like_one_process"],
        "F elsewhere: the output is sent to stage + 1": [
            "test_stage_runner_trains_like_one_process",
            "test_stage_runner_posts_an_order_nccl_can_run"],
        "B on the last stage: backward from its loss": [
            "test_stage_runner_trains_like_one_process"],
        "B elsewhere: the output's gradient received from stage + 1, output.backward(gradient)": [
            "test_stage_runner_trains_like_one_process"],
        "B on any stage but the first: its input's gradient sent to stage - 1": [
            "test_stage_runner_trains_like_one_process",
            "test_stage_runner_posts_an_order_nccl_can_run"],
        "B: free what was kept for i": [
            "test_stage_runner_frees_what_it_kept_for_a_micro_batch_after_its_backward"],
        "a send held back, then batched with the next action's receive from the same neighbour": [
            "test_stage_runner_posts_an_order_nccl_can_run"],
        "otherwise the send posted alone (dist.isend) before the next action": [
            "test_measured_bubble_matches_the_formula"],
        "each receive waited on with work.wait(timeout): a timeout raises TimeoutError": [
            "test_mismatched_schedules_end_with_a_timeout_naming_the_stage"],
        "the TimeoutError names this stage": [
            "test_mismatched_schedules_end_with_a_timeout_naming_the_stage"],
        "the TimeoutError names the action and the stage it waited for": [
            "test_a_timeout_names_the_action_and_the_stage_it_waited_for"],
        "the works of the sends posted alone are waited on before step returns": [
            "test_stage_runner_waits_for_its_lone_sends_before_step_returns"],
        "a send still held back after the last action is posted": [
            "test_stage_runner_trains_like_one_process",
            "test_stage_runner_posts_an_order_nccl_can_run"],
        "self.timeline: one (kind, i, start, end) per action": [
            "test_measured_bubble_matches_the_formula",
            "test_stage_runner_timeline_starts_empty_and_holds_the_last_step_only"],
        "self.timeline is [] from construction and started anew by each step": [
            "test_stage_runner_timeline_starts_empty_and_holds_the_last_step_only"],
        "m is the number of F actions: a list of forwards only returns their losses": [
            "test_stage_runner_evaluates_a_list_of_forwards_only"],
        "the timeline's times cover the computation only, not the receives": [
            "test_measured_bubble_matches_the_formula"],
        "returns the last stage's m losses, scaled back up (each micro-batch's own mean)": [
            "test_stage_runner_trains_like_one_process"],
        "the losses are floats": ["test_stage_runner_returns_the_losses_as_floats"],
        "an empty list on the other stages": ["test_stage_runner_trains_like_one_process"],
        "gradients accumulate in the module's parameters; the caller steps the optimizer": [
            "test_stage_runner_trains_like_one_process",
            "test_stage_runner_accumulates_the_gradients_and_leaves_the_zeroing_to_the_caller"],
    },
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
    "task7_4": {
        "torch_schedule wraps module in PipelineStage(module, stage, num_stages, device)": [
            "test_torch_pipelining_trains_like_one_process"],
        "kind='1f1b' gives Schedule1F1B": ["test_torch_pipelining_trains_like_one_process"],
        "kind='gpipe' gives ScheduleGPipe": ["test_torch_pipelining_trains_like_one_process"],
        "kind defaults to '1f1b'": ["test_torch_schedule_is_1f1b_when_no_kind_is_given"],
        "with n_microbatches=num_micro_batches and loss_fn": [
            "test_torch_pipelining_trains_like_one_process"],
        "torch averages the micro-batches' gradients (scale_grads=True)": [
            "test_torch_pipelining_trains_like_one_process"],
        "torch_step: the first stage passes the whole batch's inputs": [
            "test_torch_pipelining_trains_like_one_process",
            "test_torch_step_passes_each_stage_only_what_it_uses"],
        "torch_step: the last its targets and a list for the losses": [
            "test_torch_pipelining_trains_like_one_process",
            "test_torch_step_passes_each_stage_only_what_it_uses"],
        "torch_step: a middle stage nothing": [
            "test_torch_pipelining_trains_like_one_process",
            "test_torch_step_passes_each_stage_only_what_it_uses"],
        "torch_step: a single stage passes both": [
            "test_torch_step_on_a_single_stage_passes_the_inputs_and_the_targets"],
        "torch_step returns the last stage's micro-batch losses as floats": [
            "test_torch_pipelining_trains_like_one_process"],
        "torch_step returns an empty list on the other stages": [
            "test_torch_pipelining_trains_like_one_process"],
    },
}


@pytest.fixture
def ex():
    return load_exercise(LESSON)


# ----------------------------------------------------------------------------- shared pieces


def make_gpt(**overrides) -> GPT:
    return GPT(GPTConfig(**{**CONFIG, **overrides}), seed=0)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(200 + step)
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, CONFIG["block_size"] + 1),
                           generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@functools.cache
def one_process(steps: int = STEPS) -> dict:
    """The unsplit model on the whole batch, SGD: the parameters after each step, the first
    step's gradients, and its micro-batch losses for each micro-batch count."""
    model = make_gpt()
    optimizer = torch.optim.SGD(model.parameters(), **SGD)
    out = {"states": [], "losses": {}}
    inputs, targets = batch(0)
    with torch.no_grad():
        for m in (1, 2, 4, 8):
            out["losses"][m] = [model(x, y)[1].item()
                                for x, y in zip(inputs.chunk(m), targets.chunk(m), strict=True)]
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        model(*batch(step))[1].backward()
        if step == 0:
            out["grads"] = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        out["states"].append({name: p.detach().clone() for name, p in model.named_parameters()})
    return out


def my_stage(model: GPT, stage: int, num_stages: int) -> GPTStage:
    """The tests' own cut: equal runs of blocks (task7_3 asks for the balanced one)."""
    per = CONFIG["n_layer"] // num_stages
    return GPTStage(model, stage * per, (stage + 1) * per)


def owned(model: GPT, module: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters that ``module`` holds, by the model's names."""
    mine = {id(p) for p in module.parameters()}
    return {name: p for name, p in model.named_parameters() if id(p) in mine}


def train_stage(model: GPT, stage: nn.Module, step_fn, steps: int) -> dict:
    """SGD on this rank's ``stage`` for ``steps`` steps; ``step_fn(step)`` runs one step's
    forwards and backwards (through a pipeline) and returns the last stage's losses. The stage's
    parameters after each step (by the model's names), its gradients and losses of the first."""
    optimizer = torch.optim.SGD(stage.parameters(), **SGD)
    out = {"states": [], "grads": {}, "losses": None}
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        losses = step_fn(step)
        if step == 0:
            out["grads"] = {n: None if p.grad is None else p.grad.clone()
                            for n, p in owned(model, stage).items()}
            out["losses"] = losses
        optimizer.step()
        out["states"].append({n: p.detach().clone() for n, p in owned(model, stage).items()})
    return out


def assert_trains_like_one_process(results: list[dict], what: str, m: int) -> None:
    """Every rank's parameters (each its own stage's) against the unsplit model's."""
    __tracebackhide__ = True
    reference = one_process()
    covered = set().union(*(r["states"][0] for r in results))
    missing = sorted(set(reference["grads"]) - covered)
    assert not missing, f"{what}: no stage holds {missing[:3]}"
    for rank, got in enumerate(results):
        for name, grad in got["grads"].items():
            if grad is None:
                raise AssertionError(f"rank {rank}: {what}: {name!r} has no gradient after the "
                                     f"first step: no backward reached stage {rank}")
            try:
                assert_close(grad, reference["grads"][name], f"{what}: the first step's gradient "
                             f"of {name!r}", rank)
            except AssertionError as error:
                ratio = float((grad * reference["grads"][name]).sum()
                              / (reference["grads"][name] ** 2).sum())
                hint = (f": it is {ratio:.3g}x the whole batch's. Each micro-batch's mean loss "
                        f"is divided by m = {m} before its backward, so that the m gradients "
                        f"add up to the batch's mean" if m > 1 and abs(ratio - m) < 1e-3 * m
                        else "")
                raise AssertionError(f"{error}{hint}") from None
        for step, state in enumerate(got["states"]):
            for name, tensor in state.items():
                assert_close(tensor, reference["states"][step][name], f"{what}: {name!r} after "
                             f"SGD step {step + 1}", rank)


# ----------------------------------------------------------------------------- task7_1 schedules

# (stages, micro-batches): fewer micro-batches than a warm-up wants, too
SHAPES = [(1, 1), (2, 1), (2, 4), (3, 5), (4, 1), (4, 2), (4, 4), (4, 8)]


@pytest.mark.task7_1
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro_batches", SHAPES, ids=[f"p{p}-m{m}" for p, m in SHAPES])
def test_schedule_runs_without_deadlock_with_the_bubble_and_memory_of_the_text(
        ex, kind, stages, micro_batches):
    assert_schedule_of_the_text(ex, kind, stages, micro_batches)


@pytest.mark.task7_1
@sweep(kind=st.sampled_from(["gpipe", "1f1b"]), stages=st.integers(1, 8),
       micro_batches=st.integers(1, 16), max_examples=60)
def test_schedule_of_any_shape_is_the_texts(ex, kind, stages, micro_batches):
    """Any number of stages and micro-batches: the simulator's checks, then the order of the
    text's schedule itself (the docstring says which action comes when)."""
    plan = assert_schedule_of_the_text(ex, kind, stages, micro_batches)
    expected = reference_schedule(kind, stages, micro_batches)
    for stage, (got, want) in enumerate(zip(plan, expected, strict=True)):
        assert [tuple(a) for a in got] == want, (
            f"schedule({kind!r}, {stages}, {micro_batches}): stage {stage} runs {got}, the text's "
            f"{kind} runs {want}")


def assert_schedule_of_the_text(ex, kind: str, stages: int, micro_batches: int) -> list:
    __tracebackhide__ = True
    plan = ex.schedule(kind, stages, micro_batches)
    call = f"schedule({kind!r}, {stages}, {micro_batches})"
    assert isinstance(plan, list) and len(plan) == stages, (
        f"{call} returned {type(plan).__name__} of length {len(plan)}; expected a list with one "
        f"list of actions per stage")
    try:
        timeline = simulate([list(map(tuple, actions)) for actions in plan], micro_batches)
    except Deadlock as error:
        raise AssertionError(f"{call} deadlocks: {error}") from None
    except OrderMismatch as error:
        raise AssertionError(f"{call} would hand stages the wrong micro-batches: {error}") from None
    except ScheduleError as error:
        raise AssertionError(f"{call} is not a schedule: {error}") from None
    bubble = (stages - 1) / (micro_batches + stages - 1)
    assert timeline.bubble_fraction() == pytest.approx(bubble), (
        f"{call}: the stages are idle {timeline.bubble_fraction():.1%} of the time, expected "
        f"(p - 1) / (m + p - 1) = {bubble:.1%}: a stage waits longer than it must"
        + ("; 1F1B's stage s warms up with p - s - 1 forwards" if kind == "1f1b" else ""))
    for stage in range(stages):
        held = timeline.peak_in_flight(stage)
        expected = micro_batches if kind == "gpipe" else min(stages - stage, micro_batches)
        assert held == expected, (
            f"{call}: stage {stage} holds the activations of up to {held} micro-batches at "
            f"once, expected {expected}: "
            + ("GPipe runs every forward before any backward" if kind == "gpipe" else
               "1F1B's stage s holds at most p - s (after min(p - s - 1, m) warm-up forwards, "
               "one forward then one backward)"))
    return plan


@pytest.mark.task7_1
@pytest.mark.parametrize("arguments", [("zero-bubble", 2, 4), ("1f1b", 0, 4), ("gpipe", 2, 0)],
                         ids=["unknown-kind", "no-stages", "no-micro-batches"])
def test_schedule_rejects_what_is_not_a_pipeline(ex, arguments):
    try:
        got = ex.schedule(*arguments)
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the wrong kind of error is the finding
        raise AssertionError(f"schedule{arguments} raised {type(error).__name__}: {error}; "
                             f"raise ValueError") from None
    raise AssertionError(f"schedule{arguments} returned {got!r:.80}: raise ValueError")


# ----------------------------------------------------------------------------- task7_2 the runner


def hand_pipeline_run(ctx, kind: str, m: int, steps: int):
    """This rank's stage of the running example, run by the learner's StageRunner on the
    tests' own schedule; the stage's parameters after each step and the first step's grads."""
    ex = load_exercise(LESSON)
    model = make_gpt().to(ctx.device)
    stage = my_stage(model, ctx.rank, ctx.world_size)
    shape = (BATCH // m, CONFIG["block_size"], CONFIG["n_embd"])
    runner = ex.StageRunner(stage, ctx.rank, ctx.world_size, shape, loss_fn=next_token_loss,
                            timeout=20.0)
    actions = reference_schedule(kind, ctx.world_size, m)[ctx.rank]

    def one_step(step: int) -> list[float]:
        inputs, targets = (list(t.to(ctx.device).chunk(m)) for t in batch(step))
        # Each stage gets only what its docstring says it reads.
        return runner.step(actions, inputs=inputs if ctx.rank == 0 else None,
                           targets=targets if ctx.rank == ctx.world_size - 1 else None)

    return train_stage(model, stage, one_step, steps)


CASES = [(2, "gpipe", 1), (2, "gpipe", 4), (2, "1f1b", 2), (2, "1f1b", 8), (4, "gpipe", 4),
         (4, "1f1b", 4), (4, "1f1b", 8)]


@pytest.mark.task7_2
@pytest.mark.parametrize("world,kind,m", CASES, ids=[f"p{w}-{k}-m{m}" for w, k, m in CASES])
def test_stage_runner_trains_like_one_process(ex, world, kind, m):
    raise_if_untouched(ex.StageRunner.step, ex.StageRunner.__init__)
    results = run_on_ranks(hand_pipeline_run, kind, m, STEPS, world_size=world)
    assert_trains_like_one_process(results, f"{kind}, {world} stages, {m} micro-batches", m)
    last = results[-1]["losses"]
    assert isinstance(last, list) and len(last) == m, (
        f"the last stage's step returned {last!r:.80}: expected its {m} micro-batch losses")
    assert_close(torch.tensor(last), torch.tensor(one_process()["losses"][m]),
                 "the last stage's micro-batch losses (each micro-batch's own mean)", world - 1)
    for rank, got in enumerate(results[:-1]):
        assert got["losses"] == [], f"rank {rank}: a stage before the last returned {got['losses']}"


@pytest.mark.task7_2
@pytest.mark.parametrize("group", [g for g in GROUPS if g.values[0][1:] != ("gloo", "cpu")])
def test_stage_runner_on_cuda(ex, group):
    world, backend, device = group
    raise_if_untouched(ex.StageRunner.step)
    results = run_on_ranks(hand_pipeline_run, "1f1b", 4, STEPS, world_size=world,
                           backend=backend, device=device)
    assert_trains_like_one_process(results, f"1f1b on {backend}/{device}", 4)


P2P_FUNCTIONS = ("isend", "irecv", "send", "recv", "batch_isend_irecv")


@contextlib.contextmanager
def recorded_posts():
    """Record every point-to-point operation this rank posts, in order, as the simulator's
    posts: a lone ``isend``/``irecv`` (or ``send``/``recv``) is a post of one operation, a
    ``batch_isend_irecv`` one post of its operations. Patched in both torch.distributed and
    distributed_c10d: a ``P2POp`` accepts only the functions that module holds."""
    from torch.distributed import distributed_c10d

    posted: list[tuple[Op, ...]] = []
    real = {name: getattr(distributed_c10d, name) for name in P2P_FUNCTIONS}
    inside = [False]  # within one of the patched functions

    def lone(name):
        kind = "send" if "send" in name else "recv"
        signature = inspect.signature(real[name])

        def post(*args, **kwargs):
            if inside[0]:  # called by another of these (recv calls irecv): posted already
                return real[name](*args, **kwargs)
            bound = signature.bind(*args, **kwargs).arguments
            peer = next(bound[key] for key in ("dst", "src", "group_dst", "group_src")
                        if bound.get(key) is not None)
            posted.append((Op(kind, int(peer)),))
            return call(real[name], *args, **kwargs)
        return post

    def batch(ops):
        if not inside[0]:
            posted.append(tuple(Op("send" if op.op is patched["isend"] else "recv",
                                   int(op.peer)) for op in ops))
        return call(real["batch_isend_irecv"], ops)

    def call(function, *args, **kwargs):
        inside[0] = True
        try:
            return function(*args, **kwargs)
        finally:
            inside[0] = False

    patched = {name: lone(name) for name in P2P_FUNCTIONS[:-1]} | {"batch_isend_irecv": batch}
    for module in (dist, distributed_c10d):
        for name, function in patched.items():
            setattr(module, name, function)
    try:
        yield posted
    finally:
        for module in (dist, distributed_c10d):
            for name, function in real.items():
                setattr(module, name, function)


def posting_run(ctx, kind: str, m: int) -> list:
    """One step of the learner's StageRunner on the tests' own schedule, recording what this
    stage posts."""
    ex = load_exercise(LESSON)
    model = make_gpt()
    stage = my_stage(model, ctx.rank, ctx.world_size)
    shape = (BATCH // m, CONFIG["block_size"], CONFIG["n_embd"])
    runner = ex.StageRunner(stage, ctx.rank, ctx.world_size, shape, loss_fn=next_token_loss,
                            timeout=20.0)
    inputs, targets = (list(t.chunk(m)) for t in batch(0))
    with recorded_posts() as posted:
        runner.step(reference_schedule(kind, ctx.world_size, m)[ctx.rank],
                    inputs=inputs if ctx.rank == 0 else None,
                    targets=targets if ctx.rank == ctx.world_size - 1 else None)
    return posted


POSTING_CASES = [(2, "1f1b", 4), (4, "1f1b", 8), (4, "gpipe", 4)]


@pytest.mark.task7_2
@pytest.mark.parametrize("world,kind,m", POSTING_CASES,
                         ids=[f"p{w}-{k}-m{m}" for w, k, m in POSTING_CASES])
def test_stage_runner_posts_an_order_nccl_can_run(ex, world, kind, m):
    """gloo completes sends however they are posted; NCCL runs the operations between two
    ranks in order. The runner's recorded posts go through the simulator's model of that."""
    raise_if_untouched(ex.StageRunner.step)
    posted = run_on_ranks(posting_run, kind, m, world_size=world)
    for stage, mine in enumerate(posted):
        sends = sum(op.kind == "send" for post in mine for op in post)
        expected = m * ((stage < world - 1) + (stage > 0))
        assert sends == expected, (
            f"stage {stage} posted {sends} sends in one step of {kind} with {m} micro-batches; "
            f"expected {expected}: one per micro-batch to each neighbour")
    try:
        check_links(posted)
    except UnsafeOrder as error:
        raise AssertionError(f"{kind}, {world} stages, {m} micro-batches: the runner passes on "
                             f"gloo, but on NCCL it would hang: {error}") from None


def mismatched_run(ctx):
    """Stage 0 runs F0 B0 F1 B1, stage 1 runs F0 F1 B0 B1: stage 0 waits for B0's gradient,
    which stage 1 sends only after F1, which stage 0 sends only after B0."""
    ex = load_exercise(LESSON)
    model = make_gpt()
    stage = my_stage(model, ctx.rank, 2)
    shape = (BATCH // 2, CONFIG["block_size"], CONFIG["n_embd"])
    runner = ex.StageRunner(stage, ctx.rank, 2, shape, loss_fn=next_token_loss, timeout=2.0)
    actions = ([("F", 0), ("B", 0), ("F", 1), ("B", 1)] if ctx.rank == 0
               else [("F", 0), ("F", 1), ("B", 0), ("B", 1)])
    inputs, targets = (list(t.chunk(2)) for t in batch(0))
    started = time.monotonic()
    try:
        runner.step(actions, inputs=inputs if ctx.rank == 0 else None,
                    targets=targets if ctx.rank == 1 else None)
    except TimeoutError as error:
        return {"error": str(error), "seconds": time.monotonic() - started}
    return {"error": None, "seconds": time.monotonic() - started}


@functools.cache
def mismatched_timeouts() -> list[dict]:
    """Each rank's TimeoutError (and how long it took) for the mismatched schedules: run once,
    read by the tests of what the error says."""
    try:
        # pg_timeout 8 s: a runner that ignores its own timeout meets gloo's instead.
        return run_on_ranks(mismatched_run, world_size=2, pg_timeout=8.0, timeout=30.0)
    except RankError as error:
        raise AssertionError(
            "a mismatched pair of schedules should end in StageRunner's own TimeoutError, "
            "naming the stage; a rank raised instead (did it wait without "
            "work.wait(datetime.timedelta(seconds=self.timeout))?):\n"
            + str(error)[:1500]) from None
    finally:  # this pool's group saw receives that never completed: never reuse it
        get_pool(2, "gloo", "cpu", 8.0).close()


@pytest.mark.task7_2
def test_mismatched_schedules_end_with_a_timeout_naming_the_stage(ex):
    """The simulator calls these two schedules a deadlock; on real ranks the runner must turn
    the wait into a TimeoutError that names its stage, within its timeout (2 s here)."""
    raise_if_untouched(ex.StageRunner.step)
    assert isinstance(pytest.raises(Deadlock, simulate, [
        [("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 0), ("F", 1), ("B", 0), ("B", 1)]], 2
    ).value, Deadlock)
    results = mismatched_timeouts()
    for rank, got in enumerate(results):
        assert got["error"] is not None, (
            f"rank {rank}: the mismatched schedules finished without an error")
        assert f"stage {rank}" in got["error"], (
            f"rank {rank}: the TimeoutError should name stage {rank}: {got['error']!r}")
        assert got["seconds"] < 7, (
            f"rank {rank}: it took {got['seconds']:.1f} s to give up, with a 2 s timeout")


class EvenStage(nn.Module):
    """A stage whose forward takes 40 ms and backward 80 ms, whatever the machine is doing:
    sleeps (which need no CPU) around a tiny linear layer."""

    FORWARD, BACKWARD = 0.04, 0.08

    def __init__(self, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        time.sleep(self.FORWARD)
        return SleepInBackward.apply(self.linear(x.float()), self.BACKWARD)


class SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


def even_pipeline_run(ctx, kind: str, m: int):
    ex = load_exercise(LESSON)
    stage = EvenStage(ctx.rank == 0, ctx.rank == ctx.world_size - 1)
    runner = ex.StageRunner(stage, ctx.rank, ctx.world_size, (2, 4),
                            loss_fn=lambda out, target: ((out - target) ** 2).mean())
    data = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(m)]
    dist.barrier()
    runner.step(reference_schedule(kind, ctx.world_size, m)[ctx.rank],
                inputs=data if ctx.rank == 0 else None,
                targets=data if ctx.rank == ctx.world_size - 1 else None)
    return runner.timeline


def measured_bubble(timelines: list[list[tuple]]) -> float:
    start = min(t[2] for timeline in timelines for t in timeline)
    end = max(t[3] for timeline in timelines for t in timeline)
    busy = sum(t[3] - t[2] for timeline in timelines for t in timeline)
    return 1 - busy / (len(timelines) * (end - start))


BUBBLES = [(2, "1f1b", 1), (2, "gpipe", 4), (2, "1f1b", 4), (4, "gpipe", 4), (4, "1f1b", 4),
           (4, "1f1b", 8)]  # the README's table


@pytest.mark.task7_2
@pytest.mark.parametrize("world,kind,m", BUBBLES, ids=[f"p{w}-{k}-m{m}" for w, k, m in BUBBLES])
def test_measured_bubble_matches_the_formula(ex, world, kind, m):
    """Every stage's timeline (its computations' start and end) gathered from every rank: the
    idle share of all stages' time against (p - 1) / (m + p - 1). The stages sleep through even
    forwards and backwards, so the machine's load hardly matters; the sends and receives are
    real."""
    raise_if_untouched(ex.StageRunner.step)
    timelines = run_on_ranks(even_pipeline_run, kind, m, world_size=world)
    for rank, timeline in enumerate(timelines):
        kinds = sorted(f"{kind}{i}" for kind, i, _, _ in timeline)
        assert kinds == sorted(f"{k}{i}" for k in "FB" for i in range(m)), (
            f"rank {rank}: the timeline should hold one (kind, i, start, end) per action: "
            f"{timeline!r:.200}")
    formula = (world - 1) / (m + world - 1)
    measured = measured_bubble(timelines)
    assert abs(measured - formula) < 0.06, (
        f"{kind}, {world} stages, {m} micro-batches: the stages were idle {measured:.1%} of "
        f"the time; the formula says {formula:.1%}. Does each timeline entry cover the "
        f"computation only, not the wait for a receive?")


# Where each rank of mismatched_run waits for ever: stage 0 in B0 for stage 1's gradient, stage 1
# in F1 for stage 0's output (sent only after B0).
WAITS = {0: ("B", 0, 1), 1: ("F", 1, 0)}
ACTION_WORDS = {"B": "backward|gradient", "F": "forward|input|activation|output"}


@pytest.mark.task7_2
def test_a_timeout_names_the_action_and_the_stage_it_waited_for(ex):
    """The mismatched schedules again (one run, shared with the test above): each rank's
    TimeoutError must say in which action it waited, and for which stage."""
    raise_if_untouched(ex.StageRunner.step)
    for rank, got in enumerate(mismatched_timeouts()):
        error = got["error"]
        assert error is not None, f"rank {rank}: the mismatched schedules finished without an error"
        kind, i, peer = WAITS[rank]
        action = re.compile(rf"\b{kind}\W{{0,4}}{i}\b|(?:{ACTION_WORDS[kind]})\D{{0,40}}\b{i}\b",
                            re.IGNORECASE)
        assert action.search(error), (
            f"rank {rank}: the TimeoutError should name the action it waited in, {kind}{i} "
            f"(micro-batch {i}'s {'backward' if kind == 'B' else 'forward'}): {error!r}")
        assert f"stage {peer}" in error, (
            f"rank {rank}: the TimeoutError should name the stage it waited for, stage {peer} "
            f"(stage - 1 in a forward, stage + 1 in a backward): {error!r}")


class WatchedStage(nn.Module):
    """A tiny stage that notes, at each forward, which earlier micro-batches still have a tensor
    alive: its output, and (but on the first stage, whose inputs the caller holds) its input.
    Weak references only: it keeps nothing alive itself."""

    def __init__(self, first: bool):
        super().__init__()
        self.first = first
        self.linear = nn.Linear(4, 4)
        self.refs: list[list[weakref.ref]] = []  # per forward, in the order of the forwards
        self.alive: list[list[int]] = []  # per forward: the earlier micro-batches still alive

    def still_alive(self) -> list[int]:
        return [i for i, refs in enumerate(self.refs) if any(r() is not None for r in refs)]

    def forward(self, x):
        alive = self.still_alive()
        if len(alive) > 2:  # something may only be waiting for the cycle collector
            gc.collect()
            alive = self.still_alive()
        self.alive.append(alive)
        out = self.linear(x)
        self.refs.append([weakref.ref(out)] + ([] if self.first else [weakref.ref(x)]))
        return out


@contextlib.contextmanager
def watched_lone_sends():
    """Every send this rank posts alone (``isend``, not inside ``batch_isend_irecv``), its work
    wrapped to note whether it was waited on. Patched in torch.distributed and distributed_c10d,
    as ``recorded_posts`` does (a ``P2POp`` accepts only the functions that module holds)."""
    from torch.distributed import distributed_c10d

    real_isend, real_batch = distributed_c10d.isend, distributed_c10d.batch_isend_irecv
    lone: list[WatchedWork] = []
    inside = [False]

    def isend(*args, **kwargs):
        work = real_isend(*args, **kwargs)
        if inside[0] or work is None:
            return work
        lone.append(WatchedWork(work))
        return lone[-1]

    def batch(ops):
        inside[0] = True
        try:
            return real_batch(ops)
        finally:
            inside[0] = False

    for module in (dist, distributed_c10d):
        module.isend, module.batch_isend_irecv = isend, batch
    try:
        yield lone
    finally:
        for module in (dist, distributed_c10d):
            module.isend, module.batch_isend_irecv = real_isend, real_batch


class WatchedWork:
    """A send's work that notes its ``wait``."""

    def __init__(self, work):
        self.work, self.waited = work, False

    def wait(self, *args, **kwargs):
        self.waited = True
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


def watched_pipeline_run(ctx, m: int) -> dict:
    """One 1F1B step of WatchedStage through the learner's runner: what stayed alive at each
    forward, whether the lone sends were waited on when step returned, and what it returned."""
    ex = load_exercise(LESSON)
    stage = WatchedStage(first=ctx.rank == 0)
    runner = ex.StageRunner(stage, ctx.rank, ctx.world_size, (2, 4),
                            loss_fn=lambda out, target: ((out - target) ** 2).mean(), timeout=20.0)
    fresh = list(runner.timeline) if hasattr(runner, "timeline") else "no attribute timeline"
    data = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(m)]
    actions = reference_schedule("1f1b", ctx.world_size, m)[ctx.rank]
    with watched_lone_sends() as lone:
        losses = runner.step(actions, inputs=data if ctx.rank == 0 else None,
                             targets=data if ctx.rank == ctx.world_size - 1 else None)
        unwaited = sum(not work.waited for work in lone)
    done = [[i for kind, i in actions[:actions.index(("F", k))] if kind == "B"] for k in range(m)]
    alive, first = list(stage.alive), stage.linear.weight.grad.clone()
    runner.step(actions, inputs=data if ctx.rank == 0 else None,  # the same again, not zeroed
                targets=data if ctx.rank == ctx.world_size - 1 else None)
    return {"alive": alive, "done": done, "lone": len(lone), "unwaited": unwaited,
            "losses": [type(loss).__name__ for loss in losses],
            "grads": (first, stage.linear.weight.grad.clone()),
            "fresh": fresh, "actions": actions, "timeline": list(runner.timeline)}


@functools.cache
def watched_pipeline(m: int = 8) -> list[dict]:
    return run_on_ranks(watched_pipeline_run, m, world_size=2)


@pytest.mark.task7_2
def test_stage_runner_frees_what_it_kept_for_a_micro_batch_after_its_backward(ex):
    """1F1B holds at most p - s micro-batches' activations only if B(i) lets go of what F(i)
    kept. At each forward, the tensors of micro-batches whose backward has run must be gone
    (one or two may linger in the loop's variables until the next action replaces them)."""
    raise_if_untouched(ex.StageRunner.step, ex.StageRunner.__init__)
    for rank, got in enumerate(watched_pipeline()):
        for k, (alive, done) in enumerate(zip(got["alive"], got["done"], strict=True)):
            kept = sorted(set(alive) & set(done))
            assert len(kept) <= 2, (
                f"rank {rank}, 1F1B on 2 stages, 8 micro-batches: at F{k} the input or output "
                f"of micro-batches {kept} is still alive, though their backwards have run. Free "
                f"what was kept for i after B(i) (pop it): a stage that keeps every "
                f"micro-batch's activations needs GPipe's memory, not 1F1B's")


@pytest.mark.task7_2
def test_stage_runner_waits_for_its_lone_sends_before_step_returns(ex):
    raise_if_untouched(ex.StageRunner.step, ex.StageRunner.__init__)
    for rank, got in enumerate(watched_pipeline()):
        assert got["unwaited"] == 0, (
            f"rank {rank}: step returned with {got['unwaited']} of the {got['lone']} sends it "
            f"posted alone (dist.isend) not waited on. Keep their works and wait for each "
            f"before step returns: a send's tensor must stay alive until it is received, and "
            f"on NCCL an unfinished send still holds the link")


@pytest.mark.task7_2
def test_stage_runner_accumulates_the_gradients_and_leaves_the_zeroing_to_the_caller(ex):
    """Two steps on the same micro-batches with no zero_grad between them: the gradients add up,
    as they do for a caller accumulating over several steps."""
    raise_if_untouched(ex.StageRunner.step, ex.StageRunner.__init__)
    for rank, got in enumerate(watched_pipeline()):
        first, second = got["grads"]
        assert_close(second, 2 * first, "the weight's gradient after two steps of the same "
                     "micro-batches, not zeroed between them: twice one step's. step accumulates "
                     "into the parameters' .grad; zeroing is the caller's, with the optimizer",
                     rank)


@pytest.mark.task7_2
def test_stage_runner_returns_the_losses_as_floats(ex):
    raise_if_untouched(ex.StageRunner.step, ex.StageRunner.__init__)
    got = watched_pipeline()
    assert got[-1]["losses"] == ["float"] * 8, (
        f"the last stage's step returned losses of types {got[-1]['losses']}: return the 8 "
        f"micro-batch losses as Python floats (loss.item() * m), not tensors that keep their "
        f"graphs")
    assert got[0]["losses"] == [], f"rank 0: a stage before the last returned {got[0]['losses']}"


@pytest.mark.task7_2
def test_stage_runner_timeline_starts_empty_and_holds_the_last_step_only(ex):
    """The timeline right after construction, and after the second of two steps of 1F1B on 2
    stages: one (kind, i, start, end) per action of that step, in the actions' order."""
    raise_if_untouched(ex.StageRunner.step, ex.StageRunner.__init__)
    for rank, got in enumerate(watched_pipeline()):
        assert got["fresh"] == [], (
            f"rank {rank}: a new StageRunner's timeline is {got['fresh']!r:.100}, expected []: "
            f"set self.timeline = [] in __init__, so that it can be read before the first step")
        actions, timeline = [tuple(a) for a in got["actions"]], got["timeline"]
        kinds = [tuple(entry[:2]) for entry in timeline]
        assert kinds == actions, (
            f"rank {rank}: after the second of two steps of {len(actions)} actions the timeline "
            f"holds {len(timeline)} entries, {kinds!r:.160}; expected that step's actions only, "
            f"in their order ({actions!r:.160}). Start self.timeline anew (= []) at the start of "
            f"each step, and record each action's own kind and micro-batch")
        backwards = [entry for entry in timeline if not entry[2] <= entry[3]]
        assert not backwards, (
            f"rank {rank}: timeline entries whose end comes before their start: {backwards!r:.160}"
            f"; record (kind, i, start, end) with time.perf_counter() before and after")


def evaluation_run(ctx, m: int) -> dict:
    """A step of GPipe on 2 stages, then a step of the same forwards only (an evaluation):
    what each returned."""
    ex = load_exercise(LESSON)
    torch.manual_seed(ctx.rank)
    stage = nn.Linear(4, 4)
    runner = ex.StageRunner(stage, ctx.rank, ctx.world_size, (2, 4),
                            loss_fn=lambda out, target: ((out - target) ** 2).mean(), timeout=20.0)
    data = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(m)]
    ends = {"inputs": data if ctx.rank == 0 else None,
            "targets": data if ctx.rank == ctx.world_size - 1 else None}
    trained = runner.step(reference_schedule("gpipe", ctx.world_size, m)[ctx.rank], **ends)
    evaluated = runner.step([("F", i) for i in range(m)], **ends)
    return {"trained": trained, "evaluated": evaluated}


@pytest.mark.task7_2
def test_stage_runner_evaluates_a_list_of_forwards_only(ex):
    """m is the number of forwards in the actions: a list of forwards only (no backward) gives
    the same micro-batch losses as the training step's forwards."""
    raise_if_untouched(ex.StageRunner.step, ex.StageRunner.__init__)
    m = 4
    try:
        results = run_on_ranks(evaluation_run, m, world_size=2, timeout=60)
    except RankError as error:
        raise AssertionError(
            f"a step of {m} forwards only (no backwards), after a training step, failed on 2 "
            f"stages:\n" + str(error)[:1500]) from None
    got, want = results[-1]["evaluated"], results[-1]["trained"]
    assert isinstance(got, list) and len(got) == m, (
        f"the last stage's step of {m} forwards only returned {got!r:.80}: expected its {m} "
        f"micro-batch losses")
    assert_close(torch.tensor(got), torch.tensor(want),
                 f"the last stage's losses from a step of {m} forwards only, against those of "
                 f"the training step's forwards (m is the number of \"F\" actions: count the "
                 f"forwards, not the backwards)", 1)
    assert results[0]["evaluated"] == [], (
        f"rank 0: a stage before the last returned {results[0]['evaluated']}")


def test_micro_batches_must_be_equal(ex):
    """The lesson's rule for a batch that does not divide: a clear error, naming both numbers
    (torch's own schedules cut it unevenly instead; tests/test_torch_claims.py shows how)."""
    pieces = ex.micro_batches(torch.arange(12).view(6, 2), 3)
    assert [tuple(p.shape) for p in pieces] == [(2, 2)] * 3
    with pytest.raises(ValueError, match=r"batch of 10 does not cut into 4 equal"):
        ex.micro_batches(torch.zeros(10, 2), 4)


# ----------------------------------------------------------------------------- task7_3 the cut

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
    """Models whose best largest stage several cuts reach: the first stage's blocks as few as
    can be, then the second's, and so on (the first such cut in combinations order)."""
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
    """The cut's stages, one per process, trained through a pipeline: the unsplit model's steps."""
    raise_if_untouched(ex.split_gpt)
    results = run_on_ranks(split_gpt_pipeline_run, 4, STEPS, world_size=2, timeout=60)
    assert_trains_like_one_process(results, "split_gpt's 2 stages, 1F1B, 4 micro-batches", 4)


@pytest.mark.task7_3
def test_split_gpt_refuses_more_stages_than_blocks(ex):
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


# ----------------------------------------------------------------------------- task7_4 torch


def torch_pipeline_run(ctx, kind: str, m: int, steps: int):
    ex = load_exercise(LESSON)
    model = make_gpt().to(ctx.device)
    stage = my_stage(model, ctx.rank, ctx.world_size)
    schedule = ex.torch_schedule(stage, ctx.rank, ctx.world_size, m, next_token_loss,
                                 ctx.device, kind=kind)

    def one_step(step: int) -> list[float]:
        inputs, targets = (t.to(ctx.device) for t in batch(step))
        return ex.torch_step(schedule, ctx.rank, ctx.world_size, inputs, targets)

    return {**train_stage(model, stage, one_step, steps), "type": type(schedule).__name__}


TORCH_CASES = [(2, "1f1b", 4), (2, "gpipe", 2), (4, "1f1b", 4), (4, "gpipe", 4)]


@pytest.mark.task7_4
@pytest.mark.parametrize("world,kind,m", TORCH_CASES,
                         ids=[f"p{w}-{k}-m{m}" for w, k, m in TORCH_CASES])
def test_torch_pipelining_trains_like_one_process(ex, world, kind, m):
    """torch's schedules take the steps of the unsplit model, as the hand-written runner does
    (task7_2's test holds that one to the same reference)."""
    raise_if_untouched(ex.torch_schedule, ex.torch_step)
    results = run_on_ranks(torch_pipeline_run, kind, m, STEPS, world_size=world, timeout=60)
    expected = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}[kind]
    for rank, got in enumerate(results):
        assert got["type"] == expected, (
            f"rank {rank}: torch_schedule(kind={kind!r}) made a {got['type']}, not {expected}")
    assert_trains_like_one_process(results, f"torch's {expected}, {world} stages, {m} "
                                   f"micro-batches", m)
    assert_close(torch.tensor(results[-1]["losses"]), torch.tensor(one_process()["losses"][m]),
                 "the last stage's micro-batch losses from torch_step", world - 1)
    assert all(type(loss) is float for loss in results[-1]["losses"]), (
        f"torch_step should return the losses as floats (.item()), not "
        f"{type(results[-1]['losses'][0]).__name__}")
    for rank, got in enumerate(results[:-1]):
        assert got["losses"] == [], f"rank {rank}: a stage before the last returned losses"


def torch_default_kind_run(ctx) -> str:
    ex = load_exercise(LESSON)
    schedule = ex.torch_schedule(nn.Linear(4, 4), ctx.rank, ctx.world_size, 2,
                                 lambda out, target: ((out - target) ** 2).mean(), ctx.device)
    return type(schedule).__name__


@pytest.mark.task7_4
def test_torch_schedule_is_1f1b_when_no_kind_is_given(ex):
    raise_if_untouched(ex.torch_schedule)
    made = run_on_ranks(torch_default_kind_run, world_size=1)[0]
    assert made == "Schedule1F1B", (
        f"torch_schedule(...) without kind made a {made}: kind defaults to \"1f1b\", "
        f"Schedule1F1B")


def torch_single_stage_run(ctx, m: int, steps: int) -> dict:
    """The whole model as the one stage of a pipeline, through torch_schedule and torch_step."""
    ex = load_exercise(LESSON)
    model = make_gpt()
    stage = my_stage(model, 0, 1)
    schedule = ex.torch_schedule(stage, 0, 1, m, next_token_loss, ctx.device, kind="1f1b")

    def one_step(step: int) -> list[float]:
        return ex.torch_step(schedule, 0, 1, *batch(step))

    return train_stage(model, stage, one_step, steps)


@pytest.mark.task7_4
def test_torch_step_on_a_single_stage_passes_the_inputs_and_the_targets(ex):
    raise_if_untouched(ex.torch_schedule, ex.torch_step)
    try:
        results = run_on_ranks(torch_single_stage_run, 4, STEPS, world_size=1, timeout=60)
    except RankError as error:
        raise AssertionError(
            "torch_step on a pipeline of one stage failed. That stage is the first and the "
            "last: it passes the inputs and the targets and a list for the losses, "
            "schedule.step(inputs, target=targets, losses=losses):\n" + str(error)[:1500]
        ) from None
    assert_trains_like_one_process(results, "torch's Schedule1F1B, 1 stage, 4 micro-batches", 4)
    assert_close(torch.tensor(results[0]["losses"]), torch.tensor(one_process()["losses"][4]),
                 "the single stage's micro-batch losses from torch_step")


class RecordedSchedule:
    """Stands in for a torch schedule: notes what ``step`` is given, and on the last stage
    fills the losses list as torch does."""

    def __init__(self):
        self.calls: list[tuple[tuple, dict]] = []

    def step(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if isinstance(kwargs.get("losses"), list) and kwargs.get("target") is not None:
            kwargs["losses"].extend(torch.tensor(0.5) for _ in range(2))


@pytest.mark.task7_4
@pytest.mark.parametrize("stage", [0, 1, 2], ids=["first", "middle", "last"])
def test_torch_step_passes_each_stage_only_what_it_uses(ex, stage):
    """What torch_step hands to schedule.step on each stage of three: the first stage the
    inputs alone, the last the targets and a list for the losses, a middle stage nothing."""
    raise_if_untouched(ex.torch_step)
    schedule = RecordedSchedule()
    inputs, targets = batch(0)
    where = ["the first", "a middle", "the last"][stage] + " stage of 3"
    got = ex.torch_step(schedule, stage, 3, inputs, targets)
    assert len(schedule.calls) == 1, (
        f"torch_step on {where} called schedule.step {len(schedule.calls)} times; once")
    args, kwargs = schedule.calls[0]
    passed_inputs = any(a is inputs for a in args) or any(v is inputs for v in kwargs.values())
    passed_targets = kwargs.get("target") is targets or any(a is targets for a in args)
    if stage == 0:
        assert passed_inputs and not passed_targets, (
            f"torch_step on {where} called schedule.step(*{len(args)} args, keywords "
            f"{sorted(kwargs)}); the first stage (not also the last) passes the inputs alone, "
            f"schedule.step(inputs): the targets belong to the last stage")
        assert got == [], f"torch_step on {where} returned {got!r}; expected []"
    elif stage == 1:
        assert not args and not kwargs, (
            f"torch_step on {where} called schedule.step(*{len(args)} args, keywords "
            f"{sorted(kwargs)}); a middle stage passes nothing, schedule.step()")
        assert got == [], f"torch_step on {where} returned {got!r}; expected []"
    else:
        assert not passed_inputs and not args and passed_targets and isinstance(
            kwargs.get("losses"), list), (
            f"torch_step on {where} called schedule.step(*{len(args)} args, keywords "
            f"{sorted(kwargs)}); the last stage (not also the first) passes no inputs, only "
            f"the targets and a list for the losses, schedule.step(target=targets, "
            f"losses=losses)")
        assert got == [0.5, 0.5] and all(isinstance(x, float) for x in got), (
            f"torch_step on {where} returned {got!r}; expected the losses torch put in the "
            f"list, as floats: [0.5, 0.5]")


# ----------------------------------------------------------------------------- the script

# train_pp.py is lesson 03's train_ddp.py with the model cut into one stage per process, trained
# with torch's 1F1B schedule. On 2 ranks it must take the steps of one process on the same
# batches (lesson 00's script; pipelining changes where the model runs, not what it learns).
TRAIN = ("--epochs", "1", "--train-windows", "64")
SAME_STEPS = {"rtol": 1e-3, "atol": 2e-4}  # another summation order, AdamW (lesson 03's bound)


start_launches_first = start_first("script_run")  # while the other checks run


@pytest.fixture(scope="module")
def script_run():
    run = start_script(SCRIPT, *TRAIN, "--micro-batches", "4", launcher="torchrun", nproc=2)
    yield run
    run.stop()


@pytest.fixture(scope="module")
def reference():
    """What the script must reproduce: lesson 03's script, one process x 16, 64 windows."""
    return run_on_ranks(one_process_fit, 64, world_size=1, timeout=120)[0]["result"]


@pytest.mark.slow
def test_script_on_two_stages_trains_what_one_process_trains(script_run, reference):
    run = script_run.result()
    assert (run.data["world_size"], run.data["micro_batches"]) == (2, 4), run.data
    for key in ("train_loss", "val_loss"):
        assert_close(torch.tensor(run.data[key]), torch.tensor(reference[key]),
                     f"2 stages vs one process x 16: {key}", **SAME_STEPS)
    stages = run.data["stages"]
    assert [s["stage"] for s in stages] == [0, 1], stages
    for s in stages:
        assert s["busy_s"] > 0 and s["idle_s"] >= 0, s
    printed = [line for line in run.rank_lines(0) if line.startswith("stage ")]
    assert len(printed) == 2, run.output
    assert not [line for line in run.rank_lines(1) if line.startswith("stage ")], run.output


# CUDA kernels add in another order than the CPU's (lesson 03 measured the same bound).
CUDA_VS_CPU = {"rtol": 1e-4, "atol": 1e-5}


@pytest.mark.slow
@needs_gpus(2, "nccl, 2 stages")
def test_script_on_two_gpus_trains_what_one_process_trains_on_the_cpu(reference):
    run = run_script(SCRIPT, *TRAIN, "--micro-batches", "4", launcher="torchrun", nproc=2)
    assert (run.data["backend"], run.data["device"]) == ("nccl", "cuda:0"), run.data
    for key in ("train_loss", "val_loss"):
        assert_close(torch.tensor(run.data[key]), torch.tensor(reference[key]),
                     f"2 stages on GPUs vs one CPU process: {key}", **CUDA_VS_CPU)


@pytest.fixture
def train_script(outside_launcher):
    """train_pp.py, imported, to call its main() as plain python would run it."""
    return load_lesson_module(LESSON, "train_pp")


def test_script_refuses_more_stages_than_blocks(train_script, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert train_script.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "8 stage(s)" in err[0] and "4 blocks" in err[0], err


def test_script_refuses_a_batch_that_does_not_cut_into_micro_batches(train_script, capsys):
    assert train_script.main(["--batch-size", "10", "--micro-batches", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "10" in err[0] and "4 micro-batches" in err[0], err


def test_script_refuses_compile(train_script, capsys):
    """--compile is every script's flag, but dynamo would cut the graphs at the clock's hooks."""
    assert train_script.main(["--compile"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train_pp.py: error: --compile"), err
