"""Lesson 09, task9_5: Preemption catches the scheduler's signals and stops every rank at the
same step boundary. Swept over generated deliveries (which ranks, which signals, at which
steps) against a brute-force count, then each clause alone, in processes of their own.

    pytest lessons/09_survive_and_scale_out -m task9_5
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch.distributed as dist

from harness.collectives import CollectiveLog
from harness.exercises import raise_if_untouched
from harness.hardware import needs_gpus
from harness.ranks import RankError, in_a_child, run_on_ranks
from harness.sweep import st, sweep

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task9_5": {
        "a handler for each of signals; SIGTERM and SIGUSR1 by default": [
            "test_every_rank_stops_at_the_first_boundary_after_any_rank_is_signalled",
            "test_preemption_catches_the_signals_it_is_given_and_no_others"],
        "the handler only remembers the first signal this process caught": [
            "test_every_rank_stops_at_the_first_boundary_after_any_rank_is_signalled",
            "test_preemption_records_the_first_signal_and_does_nothing_else"],
        "it must not exit, communicate or write": [
            "test_preemption_records_the_first_signal_and_does_nothing_else"],
        "leaving the block puts back the handlers that were there before, also when it raised": [
            "test_every_rank_stops_at_the_first_boundary_after_any_rank_is_signalled",
            "test_preemption_puts_the_old_handlers_back_even_after_an_error"],
        "entered in another thread, RuntimeError saying so": [
            "test_preemption_refuses_a_thread_that_is_not_the_main_one"],
        "requested: a collective of the group, the default group when None": [
            "test_every_rank_stops_at_the_first_boundary_after_any_rank_is_signalled",
            "test_a_subgroup_agrees_among_its_members_only"],
        "one all-reduce of one number": [
            "test_every_rank_stops_at_the_first_boundary_after_any_rank_is_signalled"],
        "on device (the rank's CUDA device under nccl)": [
            "test_on_a_gpu_preemption_agrees_over_nccl"],
        "a rank that caught nothing waits; every rank gets the same answer": [
            "test_every_rank_stops_at_the_first_boundary_after_any_rank_is_signalled"],
        "True once any rank of the group has caught a signal": [
            "test_every_rank_stops_at_the_first_boundary_after_any_rank_is_signalled",
            "test_preemption_records_the_first_signal_and_does_nothing_else"],
        "once True, it stays True": [
            "test_every_rank_stops_at_the_first_boundary_after_any_rank_is_signalled"],
        "signal: the largest of the ranks' first signals when requested first returned True": [
            "test_every_rank_stops_at_the_first_boundary_after_any_rank_is_signalled",
            "test_preemption_records_the_first_signal_and_does_nothing_else"],
        "exit_code: 128 plus it, 0 before": [
            "test_every_rank_stops_at_the_first_boundary_after_any_rank_is_signalled",
            "test_preemption_records_the_first_signal_and_does_nothing_else"],
    },
}

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
BOUNDARIES = 6  # step boundaries each rank goes through
GRADE_TIMEOUT = 4  # seconds a collective may wait: a rank left waiting fails within it


class Escaped:
    """Stands where the rank's own handler was before the block: a signal that reaches it
    was not caught by the learner's, and the rank lives on to say so."""

    def __init__(self):
        self.got: list[int] = []

    def __call__(self, signum, frame):
        self.got.append(signum)


def answers_on_rank(ctx, ex_path: str, deliveries: list, members: list | None) -> dict:
    """Each member rank goes through BOUNDARIES step boundaries, is sent its deliveries (a list
    of (step, signal)) just before the boundary of their step, and asks ``requested`` there."""
    from harness.exercises import load_path

    ex = load_path(ex_path)
    group = dist.new_group(members) if members else None  # every rank calls new_group
    member = members is None or ctx.rank in members
    own = {sig: signal.getsignal(sig) for sig in SIGNALS}
    escaped = Escaped()
    for sig in SIGNALS:
        signal.signal(sig, escaped)
    answers, codes, log = [], [], None
    try:
        with CollectiveLog(ex) as log, ex.Preemption() as stop:
            for step in range(BOUNDARIES):
                for when, sig in deliveries[ctx.rank]:
                    if when == step:
                        os.kill(os.getpid(), sig)
                if member:
                    answers.append(bool(stop.requested(group=group)))
                    codes.append((int(stop.signal), int(stop.exit_code)))
        after = {sig: signal.getsignal(sig) is escaped for sig in SIGNALS}
    finally:
        for sig, handler in own.items():  # the pool's rank as it was, whatever the answer did
            signal.signal(sig, handler)
    calls = [(call.op, call.payload) for call in log.calls] if log else []
    return {"answers": answers, "codes": codes, "escaped": escaped.got, "restored": after,
            "calls": calls}


def expected(deliveries: list, members: list[int]) -> tuple[list[bool], list[tuple]]:
    """The answers and (signal, exit_code) of every boundary, counted by brute force."""
    firsts = {rank: min(deliveries[rank], key=lambda d: d[0]) for rank in members
              if deliveries[rank]}  # min keeps the first of a step's deliveries: the one caught
    if not firsts:
        return [False] * BOUNDARIES, [(0, 0)] * BOUNDARIES
    stop = min(step for step, _ in firsts.values())
    agreed = int(max(sig for step, sig in firsts.values() if step == stop))
    return ([step >= stop for step in range(BOUNDARIES)],
            [(agreed, 128 + agreed) if step >= stop else (0, 0) for step in range(BOUNDARIES)])


def check_ranks(got: list[dict], deliveries: list, members: list[int]) -> None:
    answers, codes = expected(deliveries, members)
    said = f"deliveries (step, signal) per rank {deliveries}"
    for rank, mine in enumerate(got):
        assert not mine["escaped"], (
            f"rank {rank} was sent {[signal.Signals(s).name for s in mine['escaped']]} and the "
            f"handler that was there before got it: Preemption handles each of its signals, "
            f"SIGTERM and SIGUSR1 by default ({said})")
        assert all(mine["restored"].values()), (
            f"rank {rank}: after the with block the signal handlers are not the ones that were "
            f"there before ({mine['restored']}): put them back in __exit__")
        if rank not in members:
            continue
        assert mine["answers"] == answers, (
            f"rank {rank} answered {mine['answers']} at boundaries 0..{BOUNDARIES - 1}, expected "
            f"{answers}: every rank of the group must stop at the first boundary after any of "
            f"them caught a signal, on every rank alike, and stay stopped ({said})")
        assert mine["codes"] == codes, (
            f"rank {rank}: (signal, exit_code) per boundary {mine['codes']}, expected {codes}: "
            f"the agreed signal is the largest of the ranks' first signals when requested first "
            f"returned True (a rank's later signals do not count), fixed from then on; exit_code "
            f"is 128 plus it, 0 before ({said})")
        reduces = [call for call in mine["calls"] if call[0] == "all_reduce"]
        assert len(mine["calls"]) == len(reduces) == BOUNDARIES, (
            f"rank {rank} called {mine['calls']} over {BOUNDARIES} boundaries: requested is one "
            f"all-reduce a step, nothing more")
        assert all(payload <= 8 for _, payload in reduces), (
            f"rank {rank}: all-reduces of {[p for _, p in reduces]} bytes: one number is enough")


deliveries_strategy = st.integers(2, 4).flatmap(lambda world: st.lists(
    st.lists(st.tuples(st.integers(0, BOUNDARIES - 1), st.sampled_from(SIGNALS)), max_size=2),
    min_size=world, max_size=world))


@pytest.mark.task9_5
# No shrinking: a failing example can cost a collective's timeout, a search for a smaller one
# dozens of them.
@sweep(max_examples=30, shrink=False, deliveries=deliveries_strategy)
def test_every_rank_stops_at_the_first_boundary_after_any_rank_is_signalled(ex, deliveries):
    """Sent up to 2 generated SIGTERMs or SIGUSR1s a rank before any of 6 step boundaries, on 2
    to 4 gloo ranks, `Preemption` stops every rank from the first boundary after the first
    delivery, with the largest of the ranks' first signals and 128 plus it, by a brute-force
    count; one all-reduce of at most 8 bytes a boundary.

    No signal reaches the handlers that were there before, and they are back after the block.
    """
    raise_if_untouched(ex.Preemption.__enter__, ex.Preemption.__exit__, ex.Preemption.requested)
    world = len(deliveries)
    try:
        got = run_on_ranks(answers_on_rank, str(ex.__file__), deliveries, None,
                           world_size=world, pg_timeout=GRADE_TIMEOUT, timeout=40)
    except RankError as err:
        raise AssertionError(f"deliveries {deliveries}: a rank raised or was left waiting. Every "
                             f"rank calls the same all-reduce at every boundary, and the handler "
                             f"must only record the signal (no exit, no collective): {err}"
                             ) from None
    check_ranks(got, deliveries, list(range(world)))


@pytest.mark.task9_5
def test_a_subgroup_agrees_among_its_members_only(ex):
    """On 3 gloo ranks, `requested(group=...)` on a subgroup of ranks 0 and 2 stops its members as
    a brute-force count says, and a signal to rank 1 alone, outside it, stops neither."""
    raise_if_untouched(ex.Preemption.__enter__, ex.Preemption.__exit__, ex.Preemption.requested)
    members = [0, 2]
    # Rank 1 is outside the group and is signalled first: the group must not hear of it.
    for deliveries in ([[], [(0, signal.SIGTERM)], [(3, signal.SIGUSR1)]],
                       [[(1, signal.SIGUSR1)], [], []]):
        try:
            got = run_on_ranks(answers_on_rank, str(ex.__file__), deliveries, members,
                               world_size=3, pg_timeout=GRADE_TIMEOUT, timeout=40)
        except RankError as err:
            raise AssertionError(f"ranks {members} of 3 call requested(group=...), rank 1 does "
                                 f"not: a rank raised or waited for rank 1 (is the all-reduce "
                                 f"on the group it is given?): {err}") from None
        check_ranks(got, deliveries, members)


# ----------------------------------------------------------------------- one process, one clause


def alone_in_a_group(ex_path: str, body: str) -> dict:
    """In a process of its own: a gloo group of one, then one of the checks below."""
    from harness.exercises import load_path

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return CHECKS[body][1](load_path(ex_path))
    finally:
        dist.destroy_process_group()


def check_first_signal(ex) -> dict:
    escaped = Escaped()
    for sig in SIGNALS:
        signal.signal(sig, escaped)
    seen = {}
    with ex.Preemption() as stop:
        seen["before"] = (bool(stop.requested()), int(stop.signal), int(stop.exit_code))
        os.kill(os.getpid(), signal.SIGUSR1)  # the process lives on: the handler only records
        os.kill(os.getpid(), signal.SIGTERM)
        seen["alive"] = True
        seen["after"] = (bool(stop.requested()), int(stop.signal), int(stop.exit_code))
    seen["escaped"] = escaped.got
    return seen


def check_which_signals(ex) -> dict:
    escaped = Escaped()
    for sig in (*SIGNALS, signal.SIGUSR2):
        signal.signal(sig, escaped)
    with ex.Preemption(signals=(signal.SIGUSR2,)) as stop:
        os.kill(os.getpid(), signal.SIGTERM)  # not one of its signals: the old handler's
        caught_other = bool(stop.requested())
        os.kill(os.getpid(), signal.SIGUSR2)
        mine = (bool(stop.requested()), int(stop.signal))
    return {"escaped": escaped.got, "caught_other": caught_other, "mine": mine}


def check_restored_after_an_error(ex) -> dict:
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    try:
        with ex.Preemption():
            raise KeyError("the training step failed")
    except KeyError:
        pass
    return {signal.Signals(sig).name: signal.getsignal(sig) is handler
            for sig, handler in before.items()}


def check_thread(ex) -> dict:
    seen = {}

    def enter():
        try:
            with ex.Preemption():
                seen["entered"] = True
        except RuntimeError as err:
            seen["error"] = str(err)
        except Exception as err:  # noqa: BLE001 - reported: the wrong error
            seen["other"] = f"{type(err).__name__}: {err}"

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    return seen


# Each check: what it does (for the message when the process fails), and the function.
CHECKS = {
    "first signal": ("sent SIGUSR1 then SIGTERM in a with block", check_first_signal),
    "which signals": ("Preemption(signals=(SIGUSR2,)) sent SIGTERM, then SIGUSR2",
                      check_which_signals),
    "after an error": ("a with block that raised KeyError", check_restored_after_an_error),
    "thread": ("entered in a thread that is not the main one", check_thread),
}


def in_its_own_process(ex, body: str) -> dict:
    try:
        return in_a_child(alone_in_a_group, str(ex.__file__), body, timeout=30)
    except RankError as err:
        doing = CHECKS[body][0]
        raise AssertionError(f"{doing}, the process raised or died. The handler must only "
                             f"record the signal (no exit, no collective, no save: the step "
                             f"boundary does those): {err}") from None


@pytest.mark.task9_5
def test_preemption_records_the_first_signal_and_does_nothing_else(ex):
    """Sent SIGUSR1 then SIGTERM in the block, the process lives on: `requested()` says `False`
    (signal and exit code 0) before, then `True` with SIGUSR1 and 138, the first signal, not the
    last. In a process of its own, a gloo group of one."""
    raise_if_untouched(ex.Preemption.__enter__, ex.Preemption.__exit__, ex.Preemption.requested)
    seen = in_its_own_process(ex, "first signal")
    assert seen["before"] == (False, 0, 0), (
        f"before any signal, (requested(), signal, exit_code) is {seen['before']}: expected "
        f"(False, 0, 0)")
    assert not seen["escaped"], f"the old handler got {seen['escaped']}: catch both by default"
    term, usr1 = int(signal.SIGTERM), int(signal.SIGUSR1)
    assert seen["after"] == (True, usr1, 128 + usr1), (
        f"sent SIGUSR1 ({usr1}) then SIGTERM ({term}): (requested(), signal, exit_code) is "
        f"{seen['after']}, expected (True, {usr1}, {128 + usr1}): the first signal caught is "
        f"the one remembered, not the last nor the largest, and exit_code is 128 plus it")


@pytest.mark.task9_5
def test_preemption_catches_the_signals_it_is_given_and_no_others(ex):
    """`Preemption(signals=(SIGUSR2,))` leaves SIGTERM to the handler that was there (`requested()`
    says `False`) and catches SIGUSR2. In a process of its own."""
    raise_if_untouched(ex.Preemption.__enter__, ex.Preemption.__exit__, ex.Preemption.requested)
    seen = in_its_own_process(ex, "which signals")
    assert seen["escaped"] == [int(signal.SIGTERM)] and not seen["caught_other"], (
        f"Preemption(signals=(SIGUSR2,)) must leave SIGTERM to the handler that was there: "
        f"that one got {seen['escaped']}, requested() said {seen['caught_other']}")
    assert seen["mine"] == (True, int(signal.SIGUSR2)), (
        f"Preemption(signals=(SIGUSR2,)) sent SIGUSR2: (requested(), signal) is {seen['mine']}")


@pytest.mark.task9_5
def test_preemption_puts_the_old_handlers_back_even_after_an_error(ex):
    """A `with Preemption()` block that raises `KeyError` still puts back the SIGTERM and SIGUSR1
    handlers that were there before. In a process of its own."""
    raise_if_untouched(ex.Preemption.__enter__, ex.Preemption.__exit__)
    restored = in_its_own_process(ex, "after an error")
    assert all(restored.values()), (
        f"a with block that raised left other handlers than the ones before it: {restored}. "
        f"__exit__ runs on an error too: put every old handler back there")


@pytest.mark.task9_5
def test_preemption_refuses_a_thread_that_is_not_the_main_one(ex):
    """Entered in a thread other than the main one, `Preemption` raises a `RuntimeError` that says
    "main thread". In a process of its own."""
    raise_if_untouched(ex.Preemption.__enter__)
    seen = in_its_own_process(ex, "thread")
    assert "error" in seen and "main thread" in seen["error"], (
        f"entered in another thread: {seen}. Python runs signal handlers in the main thread "
        f"only: raise RuntimeError that says 'main thread'")


def agree_over_nccl_on_rank(ctx, ex_path: str) -> dict:
    from harness.exercises import load_path

    ex = load_path(ex_path)
    own = signal.getsignal(signal.SIGTERM)
    try:
        with ex.Preemption() as stop:
            before = stop.requested(device=ctx.device)
            os.kill(os.getpid(), signal.SIGTERM)
            return {"before": before, "after": stop.requested(device=ctx.device),
                    "code": stop.exit_code}
    finally:
        signal.signal(signal.SIGTERM, own)


@pytest.mark.task9_5
@needs_gpus(1, "nccl all-reduces CUDA tensors only: requested(device=...) on a GPU")
def test_on_a_gpu_preemption_agrees_over_nccl(ex):
    """On 1 nccl rank, `requested(device=...)` with the rank's CUDA device says `False`, then
    `True` after a SIGTERM, with exit code 143."""
    raise_if_untouched(ex.Preemption.__enter__, ex.Preemption.requested)
    got = run_on_ranks(agree_over_nccl_on_rank, str(ex.__file__), world_size=1, backend="nccl",
                       device="cuda")[0]
    assert got == {"before": False, "after": True, "code": 143}, got
