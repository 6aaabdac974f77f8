"""Lesson 08, task8_5: read_step reads where a profiled DDP step went, from the trace's events.
Each clause alone first; then generated traces swept against a count over every piece of time
between two event boundaries; then real traces of DDP on gloo, with small buckets and with one.

    pytest lessons/08_measure_and_choose -m task8_5
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from harness.exercises import raise_if_untouched
from harness.ranks import run_on_ranks
from harness.sweep import st, sweep

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task8_5": {
        "only complete events (ph X) count; others have no dur": [
            "test_read_step_skips_events_that_are_not_complete",
            "test_read_step_agrees_with_a_count_over_every_piece_of_time"],
        "the step: ProfilerStep#<step>; None: the smallest number, as a number": [
            "test_read_step_takes_the_lowest_numbered_step_as_a_number",
            "test_read_step_agrees_with_a_count_over_every_piece_of_time"],
        "no such step: ValueError": ["test_read_step_refuses_a_trace_without_that_step"],
        "an event belongs when it starts inside the step; cut at the step's end": [
            "test_read_step_counts_what_starts_inside_the_step_cut_at_its_end",
            "test_read_step_agrees_with_a_count_over_every_piece_of_time"],
        "kinds by the start of the name: backward, gloo: communication, data": [
            "test_read_step_tells_the_kinds_by_the_start_of_their_names",
            "test_read_step_agrees_with_a_count_over_every_piece_of_time"],
        "a kind's time is the union of its intervals, not the sum": [
            "test_read_step_unites_overlapping_events_of_a_kind",
            "test_read_step_agrees_with_a_count_over_every_piece_of_time"],
        "exposed communication: when no backward event runs": [
            "test_read_step_exposes_only_what_no_backward_hides",
            "test_read_step_agrees_with_a_count_over_every_piece_of_time"],
        "buckets: (start from the step's start, duration, overlap), in order of start": [
            "test_read_step_lists_each_bucket_with_its_overlap",
            "test_read_step_agrees_with_a_count_over_every_piece_of_time"],
        "a real trace of DDP on gloo reads as the count reads it, every profiled step": [
            "test_read_step_reads_real_traces_of_ddp_on_gloo"],
    },
}

BACKWARD = "autograd::engine::evaluate_function: "
KINDS = {"backward": BACKWARD, "comm": "gloo:", "data": "enumerate(DataLoader)"}
NAMES = {"backward": [BACKWARD + "AddmmBackward0", BACKWARD + "torch::autograd::AccumulateGrad"],
         "comm": ["gloo:all_reduce", "gloo:broadcast"],
         "data": ["enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"],
         # Names that look like a kind and are not one: the hand-over, an op, the step marks.
         "other": ["c10d::allreduce_", "aten::mm", "AddmmBackward0", "Optimizer.step#SGD.step",
                   "DistributedDataParallel.forward", "torch::autograd::AccumulateGrad"]}


def event(name: str, ts: float, dur: float, ph: str = "X", tid: int = 1) -> dict:
    """A complete event as torch.profiler's Chrome trace holds it."""
    return {"ph": ph, "cat": "cpu_op", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur,
            "args": {}}


def profiler_step(number: int, ts: float, dur: float) -> dict:
    return {**event(f"ProfilerStep#{number}", ts, dur), "cat": "user_annotation"}


# ------------------------------------------------------------------------------------ the oracle


def oracle(events: list[dict], step: int | None = None) -> dict:
    """The reading by brute force: cut the step at every event boundary and ask, of each piece,
    which kinds run during it."""
    complete = [e for e in events if e.get("ph") == "X"]
    steps = {int(e["name"].split("#")[1]): e for e in complete
             if e["name"].startswith("ProfilerStep#")}
    chosen = steps[min(steps) if step is None else step]
    begin, end = chosen["ts"], chosen["ts"] + chosen["dur"]
    members = {kind: [(e["ts"], min(e["ts"] + e["dur"], end)) for e in complete
                      if e["name"].startswith(prefix) and begin <= e["ts"] < end]
               for kind, prefix in KINDS.items()}
    cuts = sorted({begin, end, *(t for spans in members.values() for span in spans
                                 for t in span)})
    pieces = [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if begin <= a and b <= end]

    def runs(kind, a, b):
        return any(start <= a and b <= stop for start, stop in members[kind])

    total = {kind: sum(b - a for a, b in pieces if runs(kind, a, b)) for kind in KINDS}
    exposed = sum(b - a for a, b in pieces if runs("comm", a, b) and not runs("backward", a, b))
    buckets = [(start - begin, stop - start, sum(b - a for a, b in pieces if start <= a
                                                 and b <= stop and runs("backward", a, b)))
               for start, stop in sorted(members["comm"])]
    return {"step_us": end - begin, "data_us": total["data"], "backward_us": total["backward"],
            "comm_us": total["comm"], "exposed_comm_us": exposed, "buckets": buckets}


def read(ex, events: list[dict], step=None) -> dict:
    """read_step's reading; what it raises on a trace it should read says why."""
    try:
        return ex.read_step(events) if step is None else ex.read_step(events, step)
    except KeyError as error:
        raise AssertionError(
            f"read_step raised KeyError {error}: only complete events (\"ph\": \"X\") have a "
            f"\"dur\" (and metadata events no \"ts\"); skip every other kind") from error


TOLERANCE = 1e-3  # microseconds: a real trace's times have three decimals


def same(got, expected) -> bool:
    """Equal within TOLERANCE: numbers, or lists of tuples of numbers."""
    if isinstance(expected, (list, tuple)):
        return (isinstance(got, (list, tuple)) and len(got) == len(expected)
                and all(same(a, b) for a, b in zip(got, expected, strict=True)))
    return isinstance(got, (int, float)) and abs(got - expected) <= TOLERANCE


def grade(ex, events: list[dict], step=None, *, why: str, expected: dict | None = None) -> dict:
    got = read(ex, events, step)
    expected = oracle(events, step) if expected is None else expected
    shown = "\n".join(f"  {e['name']}: {e['ts']} + {e['dur']}" for e in events
                      if e.get("ph") == "X")
    assert isinstance(got, dict) and set(got) >= set(expected), (
        f"read_step returned {got!r:.300}; expected a dict with the keys {sorted(expected)}")
    for key in ("step_us", "data_us", "backward_us", "comm_us", "exposed_comm_us"):
        assert same(got[key], expected[key]), (
            f"read_step: {key} is {got[key]!r}, expected {expected[key]!r}: {why}.\n"
            f"The complete events (name: ts + dur):\n{shown}")
    buckets = [tuple(bucket) for bucket in got["buckets"]]
    starts = [bucket[0] for bucket in buckets]
    assert starts == sorted(starts), (
        f"read_step: the buckets {buckets} are not in order of start: {why}")
    assert same(sorted(buckets), sorted(expected["buckets"])), (
        f"read_step: buckets (start from the step's start, duration, overlap with the "
        f"backward) are {buckets}, expected {expected['buckets']}: {why}.\n"
        f"The complete events (name: ts + dur):\n{shown}")
    return got


# ----------------------------------------------------------------------------- each clause alone


@pytest.mark.task8_5
def test_read_step_skips_events_that_are_not_complete(ex):
    """`read_step` counts only complete events: metadata, instant and flow events (ph M, i and s),
    which have no duration, among them change nothing; against the count over every piece of time.
    """
    events = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "a"}},
              profiler_step(3, 100, 100), event(BACKWARD + "AddmmBackward0", 110, 20),
              {"ph": "i", "name": "gloo:all_reduce", "pid": 1, "tid": 2, "ts": 120, "s": "t"},
              {"ph": "s", "id": 1, "name": "fwdbwd", "pid": 1, "tid": 1, "ts": 115,
               "cat": "fwdbwd"},
              event("gloo:all_reduce", 125, 30, tid=2)]
    grade(ex, events, why="the metadata (ph M), instant (ph i) and flow (ph s) events have no "
          "dur and are not part of any kind: only complete events (ph X) count")


@pytest.mark.task8_5
def test_read_step_takes_the_lowest_numbered_step_as_a_number(ex):
    """Without a step, `read_step` reads the lowest-numbered one, compared as a number: of
    ProfilerStep#10 and #9 it reads #9 (as strings, '10' sorts first); given step=10, it reads #10.
    """
    events = [profiler_step(10, 0, 100), event(BACKWARD + "AddmmBackward0", 10, 50),
              profiler_step(9, 200, 100), event(BACKWARD + "AddmmBackward0", 210, 20)]
    got = grade(ex, events, why="with step=None the step is ProfilerStep#9: 9 is smaller than "
                "10 as a number (as strings, '10' sorts first)")
    assert got["step_us"] == pytest.approx(100)
    grade(ex, events, 10, why="step=10 reads ProfilerStep#10")


@pytest.mark.task8_5
def test_read_step_refuses_a_trace_without_that_step(ex):
    """`read_step` raises ValueError for a trace without the step asked for: one with no
    ProfilerStep event at all, and step 2 of a trace that has only step 1."""
    raise_if_untouched(ex.read_step)
    for events, step, why in (([event(BACKWARD + "AddmmBackward0", 0, 5)], None,
                               "the trace has no ProfilerStep# event at all"),
                              ([profiler_step(1, 0, 10)], 2, "the trace has ProfilerStep#1 only")):
        with pytest.raises(ValueError):
            got = ex.read_step(events, step)
            pytest.fail(f"read_step(..., step={step}) returned {got!r:.120}; expected "
                        f"ValueError: {why}")


@pytest.mark.task8_5
def test_read_step_counts_what_starts_inside_the_step_cut_at_its_end(ex):
    """An event is the step's when it starts inside it, and counts up to the step's end: an
    all-reduce that runs past the end counts 20 of its 50 us; a backward event that began before the
    step and a data event that begins at its end do not count."""
    events = [profiler_step(1, 100, 100),
              event(BACKWARD + "AddmmBackward0", 90, 30),  # started before: not the step's
              event(BACKWARD + "AddmmBackward0", 150, 20),
              event("gloo:all_reduce", 180, 50, tid=2),  # runs past the step's end: cut there
              event("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", 200, 9)]
    got = grade(ex, events, why="an event is the step's when it starts at or after the step's "
                "start (100) and before its end (200); the all-reduce from 180 counts up to "
                "200 only; the backward from 90 and the data from 200 are not the step's")
    assert got["comm_us"] == pytest.approx(20) and got["data_us"] == 0


@pytest.mark.task8_5
def test_read_step_tells_the_kinds_by_the_start_of_their_names(ex):
    """The kinds are told by the start of their names: c10d::allreduce_, aten::mm, a bare
    AddmmBackward0 or AccumulateGrad, Optimizer.step and DistributedDataParallel.forward count as
    none; gloo:..., enumerate(DataLoader)#... and autograd::engine::evaluate_function: ... do."""
    events = [profiler_step(1, 0, 1000)]
    for k, name in enumerate(NAMES["other"]):
        events.append(event(name, 10 + 100 * k, 50))
    grade(ex, events, why="none of c10d::allreduce_ (it only hands the bucket to gloo), "
          "aten::mm, AddmmBackward0 (inside an evaluate_function event), Optimizer.step, "
          "DistributedDataParallel.forward is backward, communication or data: the kinds are "
          "told by the start of the name")
    events += [event(NAMES["comm"][0], 700, 40, tid=2), event(NAMES["data"][0], 0, 5),
               event(NAMES["backward"][0], 650, 80)]
    grade(ex, events, why="gloo:all_reduce is communication, enumerate(DataLoader)#... data, "
          "autograd::engine::evaluate_function: ... backward")


@pytest.mark.task8_5
def test_read_step_unites_overlapping_events_of_a_kind(ex):
    """A kind's time is the union of its events, not the sum: a backward event nested in another
    adds nothing (200 us, not 250), and two all-reduces on two threads covering 250 to 400 us count
    150, not 200."""
    events = [profiler_step(1, 0, 1000),
              event(BACKWARD + "AddmmBackward0", 100, 200),
              event(BACKWARD + "torch::autograd::AccumulateGrad", 150, 50),  # nested
              event("gloo:all_reduce", 250, 100, tid=2), event("gloo:all_reduce", 300, 100, tid=3)]
    got = grade(ex, events, why="a kind's time is the union of its intervals: the nested "
                "backward event adds nothing (backward 200, not 250), and the two all-reduces "
                "on two threads cover 250..400 (communication 150, not 200)")
    assert got["backward_us"] == pytest.approx(200) and got["comm_us"] == pytest.approx(150)


@pytest.mark.task8_5
def test_read_step_exposes_only_what_no_backward_hides(ex):
    """The exposed communication is the time in which an all-reduce runs and no backward event does,
    each moment once where two all-reduces overlap: communication from 150 to 500 us, with the
    backward at 100-200 and 300-400, exposes 200 us."""
    events = [profiler_step(1, 0, 1000),
              event(BACKWARD + "AddmmBackward0", 100, 100),
              event(BACKWARD + "AddmmBackward0", 300, 100),
              event("gloo:all_reduce", 150, 300, tid=2),  # 150..450: hidden 50 + 100
              event("gloo:all_reduce", 400, 100, tid=3)]  # 400..500: overlaps the other one
    got = grade(ex, events, why="communication runs 150..500; the backward hides 150..200 and "
                "300..400: exposed 200 (the time in communication with no backward running, "
                "each moment counted once even where two all-reduces overlap)")
    assert got["exposed_comm_us"] == pytest.approx(200)


@pytest.mark.task8_5
def test_read_step_lists_each_bucket_with_its_overlap(ex):
    """Each all-reduce is a bucket, listed in order of start as (start from the step's start,
    duration, the time the backward covers): (200, 100, 100) and (500, 100, 50), though the trace
    lists them the other way round."""
    events = [profiler_step(1, 1000, 1000),
              event("gloo:all_reduce", 1500, 100, tid=3),
              event(BACKWARD + "AddmmBackward0", 1100, 450),
              event("gloo:all_reduce", 1200, 100, tid=2)]
    got = grade(ex, events, why="one tuple per all-reduce, by start: (200, 100, 100) and "
                "(500, 100, 50): its start from the step's start (1000), its duration, and how "
                "much of it the backward covers")
    assert same([tuple(b) for b in got["buckets"]], [(200, 100, 100), (500, 100, 50)])


# ----------------------------------------------------------------------------- the sweep


def spans(count: int):
    return st.lists(st.tuples(st.integers(-40, 240), st.integers(0, 80)), max_size=count)


@pytest.mark.task8_5
@sweep(max_examples=40, numbers=st.lists(st.integers(1, 12), min_size=1, max_size=3, unique=True),
       backward=spans(6), comm=spans(5), data=spans(2), other=spans(3), pick=st.integers(0, 3))
def test_read_step_agrees_with_a_count_over_every_piece_of_time(ex, numbers, backward, comm,
                                                                  data, other, pick):
    """`read_step` agrees with a count over every piece of time between two event boundaries on 40
    generated traces: 1 to 3 steps numbered out of order, each with up to 6 backward, 5
    communication, 2 data and 3 look-alike events on two threads, some crossing the step's edges.

    Either the default step or a chosen one is read; metadata and flow events are mixed in; times
    agree within 1e-3 us."""
    events = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "gloo"}}]
    for k, number in enumerate(numbers):  # steps 0..200, 300..500, ... in a shuffled numbering
        events.append(profiler_step(number, 300 * k, 200))
        for kind, chosen in (("backward", backward), ("comm", comm), ("data", data),
                             ("other", other)):
            for j, (start, dur) in enumerate(chosen):
                events.append(event(NAMES[kind][j % len(NAMES[kind])], 300 * k + start, dur,
                                    tid=2 + j % 2))
        events.append({"ph": "f", "id": k, "name": "fwdbwd", "pid": 1, "tid": 1,
                       "ts": 300 * k + 5, "cat": "fwdbwd", "bp": "e"})
    step = None if pick == 0 else numbers[pick % len(numbers)]
    grade(ex, events, step, why="against a count over every piece of time between two event "
          "boundaries (each kind's union; communication with no backward running; each "
          "all-reduce's part under the backward)")


# ----------------------------------------------------------------------------- real traces


def traced_ddp_steps(ctx, bucket_cap_mb: float, path: str) -> list[dict] | None:
    """Three profiled DDP steps of six 512 x 512 layers, a DataLoader feeding them; rank 0's
    Chrome trace, as its events."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile, schedule
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)]),
                bucket_cap_mb=bucket_cap_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(torch.randn(80, 512)), batch_size=16)
    with profile(activities=[ProfilerActivity.CPU],
                 schedule=schedule(wait=1, warmup=1, active=3)) as prof:
        for (inputs,) in loader:
            model(inputs).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    if ctx.rank != 0:
        return None
    prof.export_chrome_trace(path)
    with open(path) as file:
        return json.load(file)["traceEvents"]


@pytest.mark.task8_5
def test_read_step_reads_real_traces_of_ddp_on_gloo(ex, tmp_path):
    """`read_step` reads real traces of DDP on 2 gloo ranks as the count does: six 512 x 512 layers
    fed by a DataLoader, 3 profiled steps with 1 MiB buckets (6 of them) and 3 with one bucket; the
    layers' backward runs during the small buckets' all-reduces, only the launching hook during one.

    With one bucket, at most 3 backward events overlap its all-reduce, all of them AccumulateGrad;
    with small buckets at least 2 do. Each kind's time in the first step is above 0. An all-reduce's
    event is clipped at the end of its step (see `overlapping_backward`)."""
    raise_if_untouched(ex.read_step)
    small = run_on_ranks(traced_ddp_steps, 1, str(tmp_path / "small.json"), world_size=2)[0]
    one = run_on_ranks(traced_ddp_steps, 1000, str(tmp_path / "one.json"), world_size=2)[0]
    for number in (2, 3, 4):  # the active steps of the schedule
        got = grade(ex, small, number, why=f"a real trace (6 buckets of 1 MiB), step {number}")
        assert len(got["buckets"]) == 6, got["buckets"]
        grade(ex, one, number, why=f"a real trace (one bucket), step {number}")
    got = read(ex, small)
    assert got["data_us"] > 0 and got["backward_us"] > 0 and got["comm_us"] > 0, got
    # What the text says of the two traces, read from their events: with a bucket per layer,
    # layers' backward runs during the all-reduces; with one bucket, only the gradient-ready
    # hook that launched the all-reduce (AccumulateGrad's event) is still running.
    during = overlapping_backward(small)
    assert len(during) >= 2, (
        f"with a bucket per layer the first all-reduces should run while the backward still "
        f"computes the earlier layers; the backward events during them: {during}")
    during = overlapping_backward(one)
    assert all(name.endswith("AccumulateGrad") for name in during) and len(during) <= 3, (
        f"with one bucket the all-reduce starts when the last gradient is ready; the backward "
        f"events during it: {during}")


def overlapping_backward(events: list[dict]) -> list[str]:
    """The backward events that run while an all-reduce of profiled steps 2 to 4 runs.

    An all-reduce's event is clipped at the end of its step: DDP waits for it before backward
    returns, but gloo's worker thread completes the work's future (which wakes DDP) before it
    closes the event (``ProcessGroupGloo::AsyncWork::finishWorkGloo``), so on a busy machine
    the event can end in the next step, over that step's whole backward."""
    complete = [e for e in events if e.get("ph") == "X"]
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in complete
             if e["name"].startswith("ProfilerStep#")]
    comms = [(e["ts"], min([e["ts"] + e["dur"]] + [stop for start, stop in steps
                                                  if start <= e["ts"] < stop]))
             for e in complete if e["name"].startswith("gloo:")]
    return [e["name"] for e in complete if e["name"].startswith(BACKWARD)
            and any(e["ts"] < stop and start < e["ts"] + e["dur"] for start, stop in comms)]
