"""Grades task3_5, GradientBuckets: gradients equal DDP's, one asynchronous all-reduce per bucket
in reverse order, started during backward and waited on only in wait().

    pytest lessons/03_ddp -m task3_5
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from harness.compare import assert_parameters_close, full_fp32
from harness.exercises import load_exercise
from harness.ranks import run_on_ranks
from lesson03.common import GROUPS, LESSON, make_data, make_model

# This task's contract, clause by clause, and the tests that fail when only that clause
# is broken (tests/test_course.py checks the names).
CLAUSES = {
    "task3_5": {
        "gradients equal DDP's for several steps": [
            "test_gradient_buckets_equal_ddp_and_overlap_backward"],
        "the first all-reduce starts before backward has produced the last gradient": [
            "test_gradient_buckets_equal_ddp_and_overlap_backward"],
        "all-reduce asynchronously, waited on only in wait()": [
            "test_gradient_buckets_equal_ddp_and_overlap_backward"],
        "wait() divides by the world size and copies the results into each param.grad": [
            "test_gradient_buckets_equal_ddp_and_overlap_backward"],
        "wait() resets for the next step": [
            "test_gradient_buckets_equal_ddp_and_overlap_backward",
            "test_gradient_buckets_one_all_reduce_per_bucket_in_reverse_order"],
        "buckets in reverse order, each up to bucket_size elements (default 2**20)": [
            "test_gradient_buckets_one_all_reduce_per_bucket_in_reverse_order"],
        "a parameter larger than bucket_size gets a bucket of its own": [
            "test_gradient_buckets_one_all_reduce_per_bucket_in_reverse_order"],
        "one all-reduce per bucket, once every parameter of it is ready": [
            "test_gradient_buckets_one_all_reduce_per_bucket_in_reverse_order"],
        "remove() removes the hooks": [
            "test_gradient_buckets_one_all_reduce_per_bucket_in_reverse_order"],
    },
}


class RecordedWork:
    """The work object of an asynchronous all-reduce, noting in ``events`` when it is waited on."""

    def __init__(self, work, number: int, events: list):
        self._work, self._number, self._events = work, number, events

    def wait(self, *args, **kwargs):
        self._events.append(("wait", self._number))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def bucketed_vs_ddp(ctx, steps: int):
    """Train ``steps`` steps with the learner's GradientBuckets next to DDP, recording in order
    the gradients backward produces, each dist.all_reduce (and its async_op), and each wait."""
    with full_fp32():  # compared with a CPU run: no TF32
        events: list = []
        real_all_reduce = dist.all_reduce
        started = [0]

        def recording_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            started[0] += 1
            number = started[0]
            events.append(("all_reduce", number, bool(async_op)))
            work = real_all_reduce(tensor, op=op, group=group, async_op=async_op)
            return RecordedWork(work, number, events) if async_op else work

        exercise = load_exercise(LESSON)
        ours = make_model().to(ctx.device)
        reference = DDP(copy.deepcopy(ours),
                        device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        layer_numel = sum(p.numel() for p in ours[2].parameters())  # one bucket per hidden layer
        buckets = exercise.GradientBuckets(ours, bucket_size=layer_numel)
        for name, param in ours.named_parameters():  # after theirs: runs once their hook has run
            param.register_post_accumulate_grad_hook(lambda p, name=name: events.append(name))
        first_layer = {"0.weight", "0.bias"}
        results = []
        patched = [(dist, "all_reduce")] + [(exercise, attribute) for attribute, value
                                            in vars(exercise).items() if value is real_all_reduce]
        for owner, attribute in patched:
            setattr(owner, attribute, recording_all_reduce)
        try:
            for step in range(steps):
                x, y = make_data(8, seed=100 + 10 * step + ctx.rank)
                x, y = x.to(ctx.device), y.to(ctx.device)
                events.clear()
                ours.zero_grad()
                nn.functional.mse_loss(ours(x), y).backward()
                during_backward = list(events)
                buckets.wait()
                reference.zero_grad()
                nn.functional.mse_loss(reference(x), y).backward()
                results.append({
                    "ours": {n: p.grad.clone() for n, p in ours.named_parameters()},
                    "ddp": {n: p.grad.clone() for n, p in reference.module.named_parameters()},
                    "events": during_backward,
                    "first_layer_at": min(i for i, e in enumerate(during_backward)
                                          if e in first_layer),
                })
        finally:
            for owner, attribute in patched:
                setattr(owner, attribute, real_all_reduce)
            buckets.remove()
        return results


def overlap_problem(result: dict) -> str:
    """What keeps the recorded all-reduces of one step from overlapping backward; or ""."""
    during = result["events"]
    calls = [e for e in during if isinstance(e, tuple) and e[0] == "all_reduce"]
    blocking = [e for e in calls if not e[2]]
    if blocking:
        return (f"{len(blocking)} of the {len(calls)} dist.all_reduce calls during backward ran "
                f"without async_op=True: a blocking all-reduce holds backward until the bucket "
                f"is averaged, so nothing overlaps. Start it with async_op=True, keep the work "
                f"object, and wait on it in wait()")
    waited = [e for e in during if isinstance(e, tuple) and e[0] == "wait"]
    if waited:
        return (f"work.wait() was called during backward, on {len(waited)} of the {len(calls)} "
                f"all-reduces started there: waiting right after starting blocks like a "
                f"blocking all-reduce. Call work.wait() only in wait()")
    started = [e for e in during[: result["first_layer_at"]]
               if isinstance(e, tuple) and e[0] == "all_reduce"]
    if not started:
        return (f"no dist.all_reduce started before backward reached the first layer (events: "
                f"{during}). Start each bucket's all-reduce (async_op=True) from the hooks as "
                f"soon as its gradients are ready")
    return ""


@pytest.mark.task3_5
@pytest.mark.parametrize("group", GROUPS)
def test_gradient_buckets_equal_ddp_and_overlap_backward(group):
    """GradientBuckets gives DDP's gradients for 3 steps, one bucket per hidden layer, its
    all-reduces all asynchronous, the first started before backward reaches the first layer, none
    waited on during backward: on 2 and 3 gloo ranks on the CPU, and on GPUs.

    The GPU cases: 2 gloo ranks sharing cuda:0, and nccl with one rank per GPU."""
    world, backend, device = group
    results = run_on_ranks(bucketed_vs_ddp, 3, world_size=world, backend=backend, device=device)
    for rank, steps in enumerate(results):
        for step, result in enumerate(steps):
            assert_parameters_close(result["ours"], result["ddp"], rank=rank,
                                    what=f"step {step}: bucketed gradient vs DDP's")
            problem = overlap_problem(result)
            assert not problem, f"rank {rank}, step {step}: {problem}"


class Leaves(nn.Module):
    """Parameters of the given sizes; parameter i's gradient is i + 1 everywhere, so a flat
    bucket's values tell which parameters it holds."""

    def __init__(self, sizes, frozen=()):
        super().__init__()
        self.weights = nn.ParameterList(
            nn.Parameter(torch.zeros(n), requires_grad=i not in frozen)
            for i, n in enumerate(sizes))

    def loss(self):
        return sum((i + 1) * p.sum() for i, p in enumerate(self.weights) if p.requires_grad)


def bucket_calls(ctx, sizes, frozen, bucket_size, steps=2):
    """For each step, the all-reduces started during backward (which parameters each holds,
    and its work number) and the works waited on in wait(); then what backward starts after
    remove()."""
    exercise = load_exercise(LESSON)
    model = Leaves(sizes, frozen)
    events: list = []
    real_all_reduce = dist.all_reduce

    def recording_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        number = len([e for e in events if e[0] == "all_reduce"]) + 1
        held = sorted({int(v) - 1 for v in tensor.detach().unique().tolist()})
        events.append(("all_reduce", number, held))
        work = real_all_reduce(tensor, op=op, group=group, async_op=async_op)
        return RecordedWork(work, number, events) if async_op else work

    patched = [(dist, "all_reduce")] + [(exercise, attribute) for attribute, value
                                        in vars(exercise).items() if value is real_all_reduce]
    for owner, attribute in patched:
        setattr(owner, attribute, recording_all_reduce)
    try:
        kwargs = {} if bucket_size is None else {"bucket_size": bucket_size}
        buckets = exercise.GradientBuckets(model, **kwargs)
        results = []
        for _ in range(steps):
            events.clear()
            model.zero_grad()
            model.loss().backward()
            during = list(events)
            buckets.wait()
            results.append({"started": [e for e in during if e[0] == "all_reduce"],
                            "waited": [e[1] for e in events[len(during):] if e[0] == "wait"]})
        buckets.remove()
        events.clear()
        model.zero_grad()
        model.loss().backward()
        after_remove = list(events)
    finally:
        for owner, attribute in patched:
            setattr(owner, attribute, real_all_reduce)
    return {"steps": results, "after_remove": after_remove}


BUCKET_CASES = [  # sizes, frozen, bucket_size, the buckets (parameter indices) expected
    pytest.param([300_000, 600_000, 7, 300_000, 10], (2,), None, [[1, 3, 4], [0]],
                 id="default 2**20 elements, from the last parameter, one frozen"),
    pytest.param([50, 200, 30, 30], (), 100, [[2, 3], [1], [0]],
                 id="100: a parameter of 200 gets a bucket of its own"),
    pytest.param([60, 40], (), 100, [[0, 1]], id="100: 40 + 60 fill one bucket exactly"),
    pytest.param([60, 40, 100], (), 100, [[2], [0, 1]],
                 id="100: a full bucket, then 40 + 60 fill the next one exactly"),
]


@pytest.mark.task3_5
@pytest.mark.parametrize(("sizes", "frozen", "bucket_size", "expected"), BUCKET_CASES)
def test_gradient_buckets_one_all_reduce_per_bucket_in_reverse_order(sizes, frozen,
                                                                     bucket_size, expected):
    """GradientBuckets on 2 gloo ranks starts one all-reduce per bucket, filled from the last
    parameter up to bucket_size elements (2**20 by default; a larger parameter alone; frozen ones
    left out), waits on each once per step in wait(), and starts none after remove()."""
    results = run_on_ranks(bucket_calls, sizes, frozen, bucket_size, world_size=2)
    made = f"GradientBuckets(parameters of sizes {sizes}" + (
        f", bucket_size={bucket_size})" if bucket_size is not None else ")") + (
        f", parameter(s) {list(frozen)} frozen" if frozen else "")
    for rank, result in enumerate(results):
        for step, calls in enumerate(result["steps"]):
            got = sorted(held for _, _, held in calls["started"])
            assert got == sorted(expected), (
                f"rank {rank}, step {step}: {made} all-reduced buckets holding parameters "
                f"{[held for _, _, held in calls['started']]}; expected one all-reduce per bucket, "
                f"buckets {expected}: walk the parameters that require grad from the last to the "
                f"first, start a new bucket when the next one would take it over bucket_size "
                f"elements (a larger parameter gets a bucket of its own), default 2**20")
            numbers = sorted(number for _, number, _ in calls["started"])
            assert sorted(calls["waited"]) == numbers, (
                f"rank {rank}, step {step}: wait() waited on all-reduces {calls['waited']}, "
                f"expected this step's {numbers}, each once: clear what is pending at the end "
                f"of wait(), ready for the next step")
        assert not result["after_remove"], (
            f"rank {rank}: after remove(), backward still started all-reduces "
            f"{result['after_remove']}: remove every hook's handle")
