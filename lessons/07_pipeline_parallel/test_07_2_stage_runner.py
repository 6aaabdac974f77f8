"""task7_2, the hand pipeline: a StageRunner per rank trains like the unsplit model; what it
posts is an order NCCL can run; a mismatched pair of schedules ends in a TimeoutError naming the
stage, not a hang; the idle time measured on even stages matches the bubble formula.

    pytest lessons/07_pipeline_parallel -m task7_2
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import gc
import inspect
import re
import time
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness.compare import assert_close
from harness.exercises import load_exercise, raise_if_untouched
from harness.ranks import RankError, get_pool, run_on_ranks
from lesson07.common import (
    BATCH,
    CONFIG,
    GROUPS,
    LESSON,
    STEPS,
    assert_trains_like_one_process,
    batch,
    make_gpt,
    my_stage,
    next_token_loss,
    one_process,
    train_stage,
)
from lesson07.simulator import (
    Deadlock,
    Op,
    UnsafeOrder,
    check_links,
    reference_schedule,
    simulate,
)

# The task's contract, clause by clause, and the tests that fail when only that clause is
# broken (tests/test_course.py checks the names).
CLAUSES = {
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
}


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
    """StageRunner takes the unsplit model's steps: every stage's gradients after the first step
    and parameters after each of 2 SGD steps, and the last stage's micro-batch losses, against one
    process on the whole batch; 2 and 4 gloo ranks, GPipe and 1F1B, 1 to 8 micro-batches.

    The other stages return an empty list."""
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
    """StageRunner takes the unsplit model's steps on NCCL, one rank per GPU: 1F1B with 4
    micro-batches on 2 and 4 GPUs, every stage's gradients and parameters after 2 SGD steps against
    one process on the CPU."""
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
    """What StageRunner posts is an order NCCL can run: each stage's sends and receives in one
    step, recorded on 2 and 4 gloo ranks (1F1B and GPipe), pass the simulator's check_links, with
    one send per micro-batch to each neighbour.

    gloo completes sends however they are posted; NCCL runs the operations between two ranks in
    order, which check_links models."""
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


# The runner's timeout in the mismatched run: the real waits before the deadlock (a forward of
# two tiny blocks) take milliseconds.
MISMATCH_TIMEOUT = 1.0


def mismatched_run(ctx):
    """Stage 0 runs F0 B0 F1 B1, stage 1 runs F0 F1 B0 B1: stage 0 waits for B0's gradient,
    which stage 1 sends only after F1, which stage 0 sends only after B0."""
    ex = load_exercise(LESSON)
    model = make_gpt()
    stage = my_stage(model, ctx.rank, 2)
    shape = (BATCH // 2, CONFIG["block_size"], CONFIG["n_embd"])
    runner = ex.StageRunner(stage, ctx.rank, 2, shape, loss_fn=next_token_loss,
                            timeout=MISMATCH_TIMEOUT)
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
    """Two mismatched schedules on 2 gloo ranks (F0 B0 F1 B1 against F0 F1 B0 B1), a deadlock in
    the simulator, end on each rank in StageRunner's TimeoutError naming its stage, within 7 s for
    a 1 s timeout (the process group's own is 8 s, the run's 30)."""
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
            f"rank {rank}: it took {got['seconds']:.1f} s to give up, with a "
            f"{MISMATCH_TIMEOUT:g} s timeout")


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


@functools.cache
def bubble_timelines() -> dict[tuple, list]:
    """Every row's timelines, one step each. The 2-stage rows run beside the 4-stage rows, on
    their own pool, from a second thread: the stages sleep, so the two pipelines hardly slow
    each other, and the grader waits for the 4-stage rows only."""
    worlds = sorted({world for world, _, _ in BUBBLES})
    for world in worlds:  # started here: a pool is started by one thread at a time
        if not get_pool(world).alive:
            get_pool(world).start()

    def rows_on(world: int) -> dict[tuple, list]:
        return {(w, kind, m): run_on_ranks(even_pipeline_run, kind, m, world_size=w)
                for w, kind, m in BUBBLES if w == world}

    with concurrent.futures.ThreadPoolExecutor(len(worlds)) as threads:
        return {row: timelines for rows in threads.map(rows_on, worlds)
                for row, timelines in rows.items()}


@pytest.mark.task7_2
@pytest.mark.parametrize("world,kind,m", BUBBLES, ids=[f"p{w}-{k}-m{m}" for w, k, m in BUBBLES])
def test_measured_bubble_matches_the_formula(ex, world, kind, m):
    """The idle share measured on real gloo ranks is (p - 1) / (m + p - 1) within 6 percentage
    points: every stage's timeline of one step, stages that sleep 40 ms per forward and 80 ms per
    backward, the README's six rows of 2 and 4 stages; a row that misses is measured again, at most
    twice.

    The stages sleep, so the machine's load hardly matters; the sends and receives are real. The
    first row's test runs every row (see bubble_timelines), the 2-stage rows beside the 4-stage
    rows."""
    raise_if_untouched(ex.StageRunner.step)
    timelines = bubble_timelines()[world, kind, m]
    for rank, timeline in enumerate(timelines):
        kinds = sorted(f"{kind}{i}" for kind, i, _, _ in timeline)
        assert kinds == sorted(f"{k}{i}" for k in "FB" for i in range(m)), (
            f"rank {rank}: the timeline should hold one (kind, i, start, end) per action: "
            f"{timeline!r:.200}")
    formula = (world - 1) / (m + world - 1)
    measured = measured_bubble(timelines)
    for _ in range(2):  # a busy machine can stretch one run's sleeps: measure the row again
        if abs(measured - formula) < 0.06:
            break
        again = measured_bubble(run_on_ranks(even_pipeline_run, kind, m, world_size=world))
        measured = min(measured, again, key=lambda bubble: abs(bubble - formula))
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
    """Each rank's TimeoutError from the mismatched schedules names the action it waited in (B0 on
    stage 0, F1 on stage 1) and the stage it waited for (stage 1, stage 0).

    One run of the mismatched schedules, shared with the test above."""
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
    """StageRunner lets go of a micro-batch's tensors after its backward: at each forward of 1F1B
    on 2 gloo ranks and 8 micro-batches, at most 2 micro-batches whose backward has run still have
    their input or output alive (held by weak references).

    1F1B holds at most p - s micro-batches' activations only if B(i) lets go of what F(i) kept; one
    or two may linger in the loop's variables until the next action replaces them."""
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
    """Every send StageRunner posts alone (dist.isend, not in a batch) has been waited on when step
    returns: one 1F1B step on 2 gloo ranks, 8 micro-batches, each such send's work wrapped to note
    its wait."""
    raise_if_untouched(ex.StageRunner.step, ex.StageRunner.__init__)
    for rank, got in enumerate(watched_pipeline()):
        assert got["unwaited"] == 0, (
            f"rank {rank}: step returned with {got['unwaited']} of the {got['lone']} sends it "
            f"posted alone (dist.isend) not waited on. Keep their works and wait for each "
            f"before step returns: a send's tensor must stay alive until it is received, and "
            f"on NCCL an unfinished send still holds the link")


@pytest.mark.task7_2
def test_stage_runner_accumulates_the_gradients_and_leaves_the_zeroing_to_the_caller(ex):
    """StageRunner accumulates gradients and leaves the zeroing to the caller: two 1F1B steps of
    the same 8 micro-batches on 2 gloo ranks, no zero_grad between them, give twice one step's
    gradient."""
    raise_if_untouched(ex.StageRunner.step, ex.StageRunner.__init__)
    for rank, got in enumerate(watched_pipeline()):
        first, second = got["grads"]
        assert_close(second, 2 * first, "the weight's gradient after two steps of the same "
                     "micro-batches, not zeroed between them: twice one step's. step accumulates "
                     "into the parameters' .grad; zeroing is the caller's, with the optimizer",
                     rank)


@pytest.mark.task7_2
def test_stage_runner_returns_the_losses_as_floats(ex):
    """The last stage's step returns its 8 micro-batch losses as Python floats, the first stage's
    an empty list (1F1B on 2 gloo ranks)."""
    raise_if_untouched(ex.StageRunner.step, ex.StageRunner.__init__)
    got = watched_pipeline()
    assert got[-1]["losses"] == ["float"] * 8, (
        f"the last stage's step returned losses of types {got[-1]['losses']}: return the 8 "
        f"micro-batch losses as Python floats (loss.item() * m), not tensors that keep their "
        f"graphs")
    assert got[0]["losses"] == [], f"rank 0: a stage before the last returned {got[0]['losses']}"


@pytest.mark.task7_2
def test_stage_runner_timeline_starts_empty_and_holds_the_last_step_only(ex):
    """A new StageRunner's timeline is empty, and after the second of two 1F1B steps (2 gloo ranks,
    8 micro-batches) it holds that step's actions only, in their order, one (kind, i, start, end)
    each, no end before its start."""
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
    """A step of forwards only is an evaluation: after a GPipe step on 2 gloo ranks, a step of its
    4 forwards (m counts the forwards) gives the last stage the training step's micro-batch losses,
    and the first stage an empty list."""
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


