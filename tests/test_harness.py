"""The multi-rank harness: results, errors, timeouts, clean-up, and the torchrun runner."""

from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from xml.etree import ElementTree

import pytest
import torch
import torch.distributed as dist

from course import forkserver
from harness import ranks
from harness.exercises import REPO_ROOT, solutions_mode
from harness.launch import LaunchError, run_script, start_script
from harness.processes import command_line, live_processes
from harness.ranks import NotAttemptedOnRank, RankError, RankPool, RankTimeout, run_on_ranks
from lesson07.simulator import (
    Deadlock,
    Op,
    OrderMismatch,
    ScheduleError,
    UnsafeOrder,
    check_links,
    posts,
    reference_schedule,
    simulate,
)

PROBE = Path(__file__).with_name("probes") / "launch_probe.py"


# Functions that run on the ranks live at module level: workers find them by file and name.


def sum_of_ranks(ctx, scale):
    t = torch.tensor([float(ctx.rank + 1)], device=ctx.device) * scale
    dist.all_reduce(t)
    return {"rank": ctx.rank, "world": ctx.world_size, "sum": t, "pid": os.getpid()}


def fail_on_rank_one(ctx):
    if ctx.rank == 1:
        raise ValueError("deliberate failure")
    return ctx.rank


def stub_on_every_rank(ctx):
    raise NotImplementedError("task9_1: fill in the hand-written all-reduce")


def collective_on_rank_zero_only(ctx):
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins: a hang
    return ctx.rank


def sleep_forever(ctx):
    time.sleep(3600)


def exit_on_rank_one(ctx):
    if ctx.rank == 1:
        os._exit(3)
    return ctx.rank


def graded_mode(ctx):
    return solutions_mode(), os.environ.get("COURSE_SOLUTIONS")


def _children() -> set[int]:
    """PIDs of this process's live children: zombies, multiprocessing's resource tracker
    (started once by the first spawn, lives as long as this process) and the pytest fork
    servers of course.forkserver (the same) excluded."""
    mine = {pid for pid, (parent, state) in live_processes().items()
            if parent == os.getpid() and state != "Z"
            and "resource_tracker" not in command_line(pid)}
    return mine - forkserver.server_pids()


def _alive(pid: int) -> bool:
    return live_processes().get(pid, (0, "Z"))[1] != "Z"


@pytest.mark.parametrize("world_size", [2, 3])
def test_results_come_back_in_rank_order(world_size):
    results = run_on_ranks(sum_of_ranks, 2.0, world_size=world_size)
    expected = 2.0 * world_size * (world_size + 1) / 2
    assert [r["rank"] for r in results] == list(range(world_size))
    assert all(r["world"] == world_size for r in results)
    assert all(r["sum"].item() == expected for r in results)


def test_pool_is_reused_between_calls():
    first = [r["pid"] for r in run_on_ranks(sum_of_ranks, 1.0)]
    second = [r["pid"] for r in run_on_ranks(sum_of_ranks, 1.0)]
    assert first == second


def test_rank_error_names_rank_and_shows_its_traceback_then_pool_is_rebuilt():
    before = [r["pid"] for r in run_on_ranks(sum_of_ranks, 1.0)]
    with pytest.raises(RankError) as info:
        run_on_ranks(fail_on_rank_one)
    message = str(info.value)
    assert "rank 1 raised ValueError" in message
    assert "deliberate failure" in message
    assert "--- traceback on rank 1 ---" in message and "fail_on_rank_one" in message
    assert not any(_alive(pid) for pid in before), "failed pool's workers must be stopped"
    after = [r["pid"] for r in run_on_ranks(sum_of_ranks, 1.0)]
    assert set(after).isdisjoint(before)


def test_stub_inside_a_rank_is_reported_as_not_attempted():
    with pytest.raises(NotAttemptedOnRank, match=r"task9_1: .*\(reached on rank 0\)"):
        run_on_ranks(stub_on_every_rank)


def test_collective_hang_becomes_an_error_within_the_call_timeout():
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"ranks \[0\] did not finish"):
        run_on_ranks(collective_on_rank_zero_only, timeout=3)
    assert time.monotonic() - start < 10
    assert len(run_on_ranks(sum_of_ranks, 1.0)) == 2  # the rebuilt pool works


def test_short_process_group_timeout_raises_torchs_error_on_the_stuck_rank():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 0 raised"):
        run_on_ranks(collective_on_rank_zero_only, pg_timeout=2, timeout=20)
    assert time.monotonic() - start < 15, "the 2 s process-group timeout must fire first"


def test_timeout_kills_the_workers():
    pool = RankPool(2)
    try:
        pids = [r["pid"] for r in pool.run(sum_of_ranks, 1.0)]
        with pytest.raises(RankTimeout):
            pool.run(sleep_forever, timeout=1)
        assert not any(_alive(pid) for pid in pids)
    finally:
        pool.close()


def test_a_dying_rank_is_reported():
    with pytest.raises(RankError, match=r"rank 1 raised WorkerDied.*exit code 3"):
        run_on_ranks(exit_on_rank_one)


def test_spawned_workers_find_the_function_by_path():
    # CUDA pools spawn; this proves the spawn path on CPU.
    pool = RankPool(2, start_method="spawn")
    try:
        results = pool.run(sum_of_ranks, 3.0)
        assert [r["sum"].item() for r in results] == [9.0, 9.0]
    finally:
        pool.close()


def test_a_worker_imports_a_lessons_module_by_its_name_not_by_path():
    """A rank function from a lesson's common.py (``lesson07.common``) is imported by name in
    a worker that has not imported it yet: one copy of the module, the one the test files'
    imports see, not a second loaded by path."""
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(REPO_ROOT / "lessons")!r}]
        from harness import ranks
        path = {str(REPO_ROOT / "lessons" / "07_pipeline_parallel" / "common.py")!r}
        fn = ranks._find_function(path, "lesson07.common", "make_gpt")
        import lesson07.common
        assert fn is lesson07.common.make_gpt, fn
        assert not [name for name in sys.modules if name.startswith("course_")], sorted(sys.modules)
        print("by name")
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and "by name" in run.stdout, run.stdout + run.stderr[-2000:]


def test_graded_mode_reaches_the_ranks():
    for mode, env in run_on_ranks(graded_mode):
        assert mode == solutions_mode()
        assert env == os.environ.get("COURSE_SOLUTIONS")


def test_close_all_leaves_no_child_process():
    run_on_ranks(sum_of_ranks, 1.0, world_size=3)
    ranks.close_all_pools()
    assert _children() == set()


@pytest.mark.parametrize("how", ["sigkill", "sigint"])
def test_no_orphans_when_the_parent_dies_or_is_interrupted(tmp_path, how):
    """A parent killed outright, or Ctrl-C'd mid-call, leaves no rank process behind."""
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(REPO_ROOT / "lessons")!r})
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from harness.ranks import RankPool
        import test_harness as t
        pool = RankPool(2)
        pids = [r["pid"] for r in pool.run(t.sum_of_ranks, 1.0)]
        print(" ".join(map(str, pids)), flush=True)
        pool.run(t.sleep_forever, timeout=600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2, "the parent script did not start its pool"
        time.sleep(0.5)  # let the parent block in the call
        sig = signal.SIGKILL if how == "sigkill" else signal.SIGINT
        # Ctrl-C reaches the whole foreground process group; SIGKILL only the parent.
        if how == "sigint":
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        proc.wait(timeout=20)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in pids), f"orphaned rank processes after {how}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_group_params_cover_the_hardware_matrix():
    ids = [p.id for p in ranks.group_params()]
    assert ids[:3] == ["gloo-cpu-2", "gloo-cpu-3", "gloo-cuda-2"]
    assert "nccl-cuda-1" in ids and "nccl-cuda-2" in ids
    nccl_two = next(p for p in ranks.group_params() if p.id == "nccl-cuda-2")
    if torch.cuda.device_count() < 2:
        reasons = [m.kwargs.get("reason", "") for m in nccl_two.marks if m.name == "skipif"]
        assert reasons and reasons[0].startswith("needs 2 CUDA GPUs")


# ------------------------------------------------------------------------- the torchrun runner


@pytest.mark.slow
@pytest.mark.parametrize("launcher,nproc", [("python", 1), ("torchrun", 2), ("launch", 2)])
def test_runner_returns_rank_zero_result_and_tagged_output(launcher, nproc):
    run = run_script(PROBE, launcher=launcher, nproc=nproc, env={"COURSE_SOLUTIONS": "1"})
    assert run.data["world_size"] == nproc
    assert run.data["solutions_mode"] is True, "the graded mode must reach launched ranks"
    if launcher == "launch":
        assert run.data["local_rank_arg"] == 0  # launch passes --local-rank=N
    if launcher != "python":
        for rank in range(nproc):
            assert f"probe rank {rank} of {nproc}" in "\n".join(run.rank_lines(rank))


@pytest.mark.slow
def test_runner_timeout_kills_every_rank():
    start = time.monotonic()
    with pytest.raises(LaunchError, match="timeout") as info:
        run_script(PROBE, "--hang", launcher="torchrun", nproc=2, timeout=8)
    assert time.monotonic() - start < 20
    # torchrun puts each rank in a session of its own: they are not our children, so look
    # for the very processes the probe reported.
    ranks = [int(pid) for pid in re.findall(r"probe rank \d of 2 pid (\d+)", str(info.value))]
    assert len(ranks) == 2, f"the probe's ranks did not report in time:\n{info.value}"
    assert not [pid for pid in ranks if _alive(pid)], "rank processes survived the timeout"
    assert _children() == set()


@pytest.mark.slow
def test_runner_reports_a_failing_script_with_its_output():
    with pytest.raises(LaunchError, match=r"exited with 1(.|\n)*deliberate failure"):
        run_script(PROBE, "--fail", launcher="python")


@pytest.mark.slow
def test_runner_reports_a_stub_reached_in_a_launched_rank_as_not_attempted():
    with pytest.raises(NotImplementedError, match=r"task9_2: .*\(reached in a launched process\)"):
        run_script(PROBE, "--stub", launcher="torchrun", nproc=2)


@pytest.mark.slow
def test_started_scripts_run_concurrently_and_are_collected_later():
    start = time.monotonic()
    runs = [start_script(PROBE, launcher="python") for _ in range(3)]
    assert time.monotonic() - start < 1, "start_script must not wait for the script"
    assert [run.result().data["world_size"] for run in runs] == [1, 1, 1]


def test_torchrun_launches_use_the_console_script_a_learner_types():
    """A broken ``torchrun`` entry point must fail the tests, not hide behind ``python -m``."""
    from harness.launch import LAUNCHERS

    script = Path(sys.executable).with_name("torchrun")
    expected = str(script) if script.is_file() else sys.executable
    assert LAUNCHERS["torchrun"][0] == expected


def test_a_shell_script_finds_this_interpreters_torchrun_and_python_unactivated(
        tmp_path, monkeypatch):
    """``pytest`` run as ``.venv/bin/python -m pytest`` without activating the venv: a batch
    script that calls ``torchrun`` and ``python`` by name must still get the venv's."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no venv on it
    script = tmp_path / "which.sh"
    script.write_text("command -v python; command -v torchrun || echo missing\n")
    run = start_script(script, launcher="bash", result=False).result()
    here = Path(sys.executable).parent
    found = run.output.split()
    assert found[0] == str(here / "python"), run.output
    if (here / "torchrun").is_file():
        assert found[1] == str(here / "torchrun"), run.output


def test_a_wrong_answer_replaces_functions_and_only_the_methods_it_defines():
    from course.selfcheck import with_wrong_answer

    solution = textwrap.dedent('''
        import os


        def f(x):
            return x + 1


        class C:
            """Kept."""

            def a(self):
                return 1

            def b(self):
                return 2
    ''')
    wrong = textwrap.dedent('''
        """The docstring and the constants are not copied."""
        import math

        TASK = "task9_1"


        def f(x):
            return x - 1


        class C:
            def b(self):
                return math.inf
    ''')
    namespace: dict = {}
    exec(with_wrong_answer(solution, wrong), namespace)  # noqa: S102 - our own test source
    assert namespace["f"](1) == 0 and "TASK" not in namespace
    assert namespace["C"]().a() == 1 and namespace["C"]().b() == float("inf")
    assert namespace["C"].__doc__ == "Kept."
    with pytest.raises(ValueError, match="not a method"):
        with_wrong_answer(solution, "class C:\n    def z(self):\n        pass\n")
    with pytest.raises(ValueError, match="which the solution does not"):
        with_wrong_answer(solution, "def g():\n    pass\n")



def test_a_wrong_answer_may_replace_one_line_of_the_reference():
    from course.selfcheck import with_wrong_answer

    solution = "def f(x):\n    y = x + 1\n    return y * 2\n\n\ndef g(x):\n    return x + 1\n"
    wrong = 'TASK = "task9_1"\nREPLACE = {"f": [("x + 1", "x - 1"), ("* 2", "* 3")]}\n'
    namespace: dict = {}
    exec(with_wrong_answer(solution, wrong), namespace)  # noqa: S102 - our own test source
    assert namespace["f"](1) == 0 and namespace["g"](1) == 2, "only f changes"
    with pytest.raises(ValueError, match="occurs 0 times"):
        with_wrong_answer(solution, 'REPLACE = {"f": [("x + 2", "x")]}\n')
    with pytest.raises(ValueError, match="which the solution does not define"):
        with_wrong_answer(solution, 'REPLACE = {"h": [("x", "y")]}\n')


# --------------------------------------------------------------------------------------------
# course.forkserver: graded runs forked from a server that has imported torch once.


def _pytest_folder(tmp_path: Path, test_source: str) -> Path:
    folder = tmp_path / "run"
    (folder / "mine").mkdir(parents=True)
    (folder / "mine" / "__init__.py").write_text("WHERE = 'this folder'\n")
    (folder / "test_it.py").write_text(textwrap.dedent(test_source))
    return folder


def test_forkserver_runs_pytest_in_the_folder_with_the_environment_given(tmp_path):
    marker = tmp_path / "atexit-ran"
    folder = _pytest_folder(tmp_path, f"""
        import atexit, os, sys
        import mine

        # The end of a normal interpreter runs these (the rank pools stop their workers here):
        # a forked run must too.
        atexit.register(lambda: open({str(marker)!r}, "w").write("ran"))

        def test_it():
            print("cwd", os.getcwd(), "x", os.environ.get("COURSE_X"), "home", "HOME" in os.environ)
            assert mine.WHERE == "this folder"
            assert "torch" in sys.modules  # imported by the server, before the fork

        def test_fails():
            assert False, "this one fails"
    """)
    code, output = forkserver.run_pytest(["-q", "-s", "-p", "no:cacheprovider", "test_it.py"],
                                         folder, {"COURSE_X": "1", "PATH": os.environ["PATH"]},
                                         timeout=60)
    assert code == 1, output  # pytest's "some tests failed"
    assert f"cwd {folder} x 1 home False" in output, output
    assert "1 failed, 1 passed" in output, output
    assert marker.exists(), "the run's atexit handlers did not run"


def test_forkserver_kills_a_run_and_its_children_at_the_timeout(tmp_path):
    marker = tmp_path / "child.pid"
    folder = _pytest_folder(tmp_path, f"""
        import subprocess, time

        def test_hangs():
            child = subprocess.Popen(["sleep", "300"])
            open({str(marker)!r}, "w").write(str(child.pid))
            time.sleep(300)
    """)
    started = time.monotonic()
    code, _ = forkserver.run_pytest(["-q", "-p", "no:cacheprovider", "-p", "no:timeout",
                                     "test_it.py"], folder, dict(os.environ), timeout=5)
    assert code == forkserver.TIMED_OUT
    assert time.monotonic() - started < 30
    child = int(marker.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), f"the run's child {child} outlived the timeout"


def test_raise_if_untouched_tells_a_stub_from_an_answer():
    from harness.exercises import raise_if_untouched, task_of

    def stub(x):
        """The contract."""
        raise NotImplementedError("task9_9: write this")

    def answer(x):
        """The contract."""
        return x

    def refuses(x):
        raise NotImplementedError("not supported")  # a real answer may raise this

    with pytest.raises(NotImplementedError) as info:
        raise_if_untouched(stub)
    assert task_of(info.value) == "task9_9"
    raise_if_untouched(answer)
    raise_if_untouched(refuses)
    with pytest.raises(NotImplementedError, match="task9_9"):  # any one of several
        raise_if_untouched(answer, stub, refuses)
    raise_if_untouched(answer, refuses)


# ----------------------------------------------------------------------------- memory


def test_held_bytes_counts_each_storage_once_with_gradients_and_hooks():
    from harness.memory import held_bytes, held_tensors

    layer = torch.nn.Linear(10, 10)  # 100 + 10 floats
    assert held_bytes(layer) == 4 * 110
    layer(torch.randn(3, 10)).sum().backward()
    assert held_bytes(layer) == 2 * 4 * 110, "the gradients count too"

    class Holder:
        def __init__(self, model):
            self.model = model
            self.views = [p.detach().view(-1)[:3] for p in model.parameters()]  # same storage
            self.extra = torch.zeros(25)

    holder = Holder(layer)
    assert held_bytes(holder) == 2 * 4 * 110 + 4 * 25
    assert held_bytes(holder, exclude=[layer]) == 4 * 25, "exclude drops what the model holds"
    captured = torch.zeros(7)
    layer.register_forward_hook(lambda module, args, out: captured.sum())
    assert held_bytes(layer) == 2 * 4 * 110 + 4 * 7, "a hook's closure holds its tensors"
    paths = {held.path for held in held_tensors(holder).values()}
    assert any("extra" in path for path in paths), paths
    layer.weight.kept = torch.zeros(9)  # a tensor hidden on a parameter still counts
    assert held_bytes(layer) == 2 * 4 * 110 + 4 * 7 + 4 * 9


def test_held_bytes_sees_freed_storage_and_meta_tensors_as_nothing():
    from harness.memory import held_bytes

    freed = torch.zeros(100)
    freed.untyped_storage().resize_(0)  # how FSDP frees a gathered parameter
    assert held_bytes([freed, torch.empty(50, device="meta")]) == 0
    assert held_bytes({"kept": torch.zeros(3, dtype=torch.float64)}) == 24


def test_held_bytes_does_not_walk_into_globals():
    from harness.memory import held_bytes

    def uses_a_global():
        return GLOBAL_TENSOR.sum()

    assert held_bytes([uses_a_global]) == 0, "a function's globals are the program's"


GLOBAL_TENSOR = torch.zeros(1000)


def test_allocation_peak_is_the_most_bytes_alive_at_once():
    from harness.memory import AllocationPeak

    with AllocationPeak() as peak:
        first = torch.ones(1000)  # 4 kB
        del first
        kept = [torch.ones(500), torch.ones(250)]  # 3 kB together
        view = kept[0][:10]  # no new storage
        kept[0] = None  # its storage lives on in the view
    assert peak.bytes == 4000, peak.bytes
    assert peak.live_bytes() == 3000, peak.live_bytes()
    del view
    assert peak.live_bytes() == 1000, peak.live_bytes()
    with AllocationPeak() as both:
        together = [torch.ones(1000), torch.ones(500)]
    assert both.bytes == 6000 and len(together) == 2, both.bytes


def test_allocation_peak_counts_a_storage_at_its_size_now_and_leaves_out_what_it_ignores():
    """FSDP frees a gathered parameter by resizing its storage to nothing and gathers it again
    into the same storage: counted at its size at each moment, never twice. An in-place
    operator returns a storage from before: counted, unless ``ignore`` names it."""
    from harness.memory import AllocationPeak

    kept = torch.zeros(250)  # 1 kB that exists before and stays
    with AllocationPeak() as peak:
        gathered = torch.ones(1000)  # 4 kB
        gathered.untyped_storage().resize_(0)
        other = torch.ones(750)  # 3 kB: the peak is still the 4 kB before it
        gathered.untyped_storage().resize_(4000)
        again = gathered.add_(1)  # the same storage, grown back: 4 + 3 kB, not 4 + 4 + 3
    assert peak.bytes == 7000 and again is gathered and len(other) == 750, peak.bytes
    with AllocationPeak() as counted:
        kept.add_(1)
    with AllocationPeak(ignore=[kept]) as ignored:
        kept.add_(1)
        torch.ones(10)
    assert (counted.bytes, ignored.bytes) == (1000, 40), (counted.bytes, ignored.bytes)


def test_allocation_peak_counts_the_tensors_inside_a_wrapper_subclass():
    """A wrapper subclass (here torch's test TwoTensor; a DTensor, the functional collectives'
    AsyncCollectiveTensor) has no storage of its own: the tensors it flattens to count."""
    from torch.testing._internal.two_tensor import TwoTensor

    from harness.memory import AllocationPeak

    pair = TwoTensor(torch.ones(100), torch.ones(100))
    with AllocationPeak() as peak:
        doubled = pair * 2  # two new 400-byte tensors inside one wrapper
    assert peak.bytes == 800 and isinstance(doubled, TwoTensor), peak.bytes


# ----------------------------------------------------------------------------- collectives


def collectives_counted(ctx):
    from harness.collectives import CollectiveLog

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    alias = type("Module", (), {"gather": gather})  # a module's own name for a collective
    with CollectiveLog(alias) as log:
        dist.all_reduce(torch.ones(8))  # 32 bytes
        whole = torch.empty(2 * ctx.world_size)
        alias.gather(whole, torch.ones(2))  # 8 bytes per rank, gathered whole
        dist.reduce_scatter_tensor(torch.empty(3), torch.ones(3 * ctx.world_size))  # old name
        dist.broadcast(torch.ones(5), src=0)
    restored = dist.all_reduce is log_real_all_reduce() and alias.gather is gather
    del whole
    # The log holds the output weakly: it goes once gloo's work lets go of it too, which on a
    # loaded machine can be a moment after the call returns.
    deadline = time.monotonic() + 5
    while log.of("all_gather")[0].alive() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return {"ops": [(c.op, c.payload) for c in log.calls], "ring": log.ring_bytes(ctx.world_size),
            "summary": log.summary(), "restored": restored,
            "gathered_freed": not log.of("all_gather")[0].alive()}


def collective_group_sizes(ctx):
    from harness.collectives import CollectiveLog

    pair = dist.new_group([0, 1])
    alone = [dist.new_group([rank]) for rank in range(ctx.world_size)][ctx.rank]
    with CollectiveLog() as log:
        dist.all_reduce(torch.ones(2))  # the default group
        dist.all_reduce(torch.ones(2), group=alone)  # by keyword
        if ctx.rank < 2:
            dist.all_reduce(torch.ones(2), dist.ReduceOp.SUM, pair)  # by position
    return [call.ranks for call in log.calls]


def test_collective_log_records_the_size_of_each_call_s_group():
    for rank, sizes in enumerate(run_on_ranks(collective_group_sizes, world_size=3)):
        assert sizes == ([3, 1, 2] if rank < 2 else [3, 1]), (rank, sizes)


def all_reduces_dispatched(ctx):
    from torch.distributed._functional_collectives import all_reduce as functional_all_reduce

    from harness.collectives import DispatchedAllReduces

    with DispatchedAllReduces() as sent:
        dist.all_reduce(torch.ones(8))  # c10d: 32 bytes
        dist.all_reduce(torch.ones(5, dtype=torch.float16))  # 10 bytes
        float(functional_all_reduce(torch.ones(3), "sum", dist.group.WORLD).sum())  # DTensor's kind
        dist.broadcast(torch.ones(7), src=0)  # not an all-reduce
    return sent.calls


def test_dispatched_all_reduces_sees_c10d_and_functional_ones_with_dtype_and_bytes():
    for calls in run_on_ranks(all_reduces_dispatched, world_size=2):
        assert calls == [("torch.float32", 32), ("torch.float16", 10), ("torch.float32", 12)], (
            calls)


def log_real_all_reduce():
    import torch.distributed.distributed_c10d as c10d

    return c10d.all_reduce


def test_collective_log_counts_payloads_once_and_restores_the_functions():
    world = 2
    for result in run_on_ranks(collectives_counted, world_size=world):
        # reduce_scatter_tensor forwards to reduce_scatter_single in new torch: counted once
        assert result["ops"] == [("all_reduce", 32), ("all_gather", 8 * world),
                                 ("reduce_scatter", 12 * world), ("broadcast", 20)], result
        share = (world - 1) / world
        assert result["ring"] == share * (2 * 32 + 16 + 24 + 20), result
        assert result["restored"] and result["gathered_freed"], result
        assert "1 all_reduce (0.0 kB)" in result["summary"], result["summary"]


# ----------------------------------------------------------------------------- pipeline schedules


def gpipe(stages: int, micro_batches: int):
    return reference_schedule("gpipe", stages, micro_batches)


def one_f_one_b(stages: int, micro_batches: int):
    return reference_schedule("1f1b", stages, micro_batches)


def test_pipeline_simulator_times_a_small_gpipe_by_hand():
    # 2 stages, 2 micro-batches, forward 1, backward 2:
    # stage 0: F0 [0,1] F1 [1,2]                   B1 [5,7] B0 [7,9]
    # stage 1:          F0 [1,2] F1 [2,3] B1 [3,5] B0 [5,7]
    timeline = simulate(gpipe(2, 2), 2)
    times = {(s.stage, f"{s.kind}{s.micro_batch}"): (s.start, s.end) for s in timeline.slots}
    assert times == {(0, "F0"): (0, 1), (0, "F1"): (1, 2), (1, "F0"): (1, 2),
                     (1, "F1"): (2, 3), (1, "B1"): (3, 5), (1, "B0"): (5, 7),
                     (0, "B1"): (5, 7), (0, "B0"): (7, 9)}
    assert timeline.makespan == 9
    assert timeline.busy(0) == timeline.busy(1) == 6
    assert timeline.bubble_fraction() == pytest.approx(1 / 3)  # (p - 1) / (m + p - 1)


def test_pipeline_simulator_times_chunks_and_split_backwards_by_hand():
    # Interleaved, 2 ranks x 2 chunks, 1 micro-batch, forward 1 and backward 2 per rank, so
    # a chunk's are 0.5 and 1; stages 0..3 are rank 0 chunk 0, rank 1 chunk 0, rank 0 chunk 1,
    # rank 1 chunk 1: F runs 0-0.5, 0.5-1, 1-1.5, 1.5-2 and B back 2-3, 3-4, 4-5, 5-6.
    plan = [[("F", 0, 0), ("F", 0, 1), ("B", 0, 1), ("B", 0, 0)],
            [("F", 0, 0), ("F", 0, 1), ("B", 0, 1), ("B", 0, 0)]]
    timeline = simulate(plan, 1, posting=None)
    times = {(s.stage, s.kind, s.chunk): (s.start, s.end) for s in timeline.slots}
    assert times == {(0, "F", 0): (0, 0.5), (1, "F", 0): (0.5, 1), (0, "F", 1): (1, 1.5),
                     (1, "F", 1): (1.5, 2), (1, "B", 1): (2, 3), (0, "B", 1): (3, 4),
                     (1, "B", 0): (4, 5), (0, "B", 0): (5, 6)}
    assert timeline.peak_in_flight(0) == 2 and timeline.peak_activations(0) == 1
    with pytest.raises(ValueError, match="posting=None"):
        simulate(plan, 1)
    # Zero bubble, 2 stages, 1 micro-batch, F = B = W = 1: a W waits for nobody but its B.
    # stage 0: F0 [0,1]                B0 [3,4] W0 [4,5]
    # stage 1:          F0 [1,2] B0 [2,3] W0 [3,4]
    split = [[("F", 0), ("B", 0), ("W", 0)]] * 2
    timeline = simulate(split, 1, backward_time=2.0, posting=None)
    times = {(s.stage, f"{s.kind}{s.micro_batch}"): (s.start, s.end) for s in timeline.slots}
    assert times == {(0, "F0"): (0, 1), (1, "F0"): (1, 2), (1, "B0"): (2, 3), (1, "W0"): (3, 4),
                     (0, "B0"): (3, 4), (0, "W0"): (4, 5)}
    assert timeline.makespan == 5 and timeline.peak_in_flight(0) == 1
    with pytest.raises(ScheduleError, match=r"\('W', 0\) before \('B', 0\)"):
        simulate([[("F", 0), ("W", 0), ("B", 0)]], 1, posting=None)
    with pytest.raises(ScheduleError, match=r"stage 1 never runs \[\('W', 0\)\]"):
        simulate([[("F", 0), ("B", 0), ("W", 0)], [("F", 0), ("B", 0)]], 1, posting=None)


@pytest.mark.parametrize("make", [gpipe, one_f_one_b], ids=["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro_batches", [(2, 1), (2, 4), (4, 4), (4, 8), (3, 7)])
def test_pipeline_simulator_finds_the_bubble_formula(make, stages, micro_batches):
    for forward, backward in ((1.0, 2.0), (1.0, 1.0), (2.0, 3.0)):
        timeline = simulate(make(stages, micro_batches), micro_batches, forward, backward)
        assert timeline.bubble_fraction() == pytest.approx(
            (stages - 1) / (micro_batches + stages - 1))


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (4, 4), (4, 8), (3, 7)])
def test_pipeline_simulator_counts_activations_in_flight(stages, micro_batches):
    held = [simulate(make(stages, micro_batches), micro_batches).peak_in_flight(s)
            for make in (gpipe, one_f_one_b) for s in range(stages)]
    assert held[:stages] == [micro_batches] * stages  # GPipe: every micro-batch
    assert held[stages:] == [min(stages - s, micro_batches) for s in range(stages)]  # 1F1B


def test_pipeline_simulator_names_what_each_stuck_stage_waits_for():
    # Stage 0 waits for B0 after F0; stage 1 wants F1 before it runs B0: neither can go on.
    stuck = [[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 0), ("F", 1), ("B", 0), ("B", 1)]]
    with pytest.raises(Deadlock, match=r"stage 0 waits to run B0 for B0 from stage 1; "
                                       r"stage 1 waits to run F1 for F1 from stage 0"):
        simulate(stuck, 2)


def test_pipeline_simulator_refuses_neighbours_that_pass_micro_batches_in_other_orders():
    # No deadlock (the simulator matches by micro-batch), but stage 1 sends gradients 0, 1
    # while stage 0 posts its receives for 1, 0: on real ranks, B1 would get B0's gradient.
    crossed = [[("F", 0), ("F", 1), ("B", 1), ("B", 0)], [("F", 0), ("F", 1), ("B", 0), ("B", 1)]]
    with pytest.raises(OrderMismatch, match=r"stage 1 sends its gradients in the order \[0, 1\] "
                                            r"but stage 0 receives them in the order \[1, 0\]"):
        simulate(crossed, 2)
    simulate([crossed[0], crossed[0]], 2)  # the same order on both: fine


@pytest.mark.parametrize("stages,micro_batches", [(2, 2), (2, 8), (3, 5), (4, 4), (4, 8)])
def test_pipeline_simulator_refuses_1f1b_posted_one_operation_at_a_time(stages, micro_batches):
    """On NCCL, 1F1B's neighbours each post a send whose receive waits behind the other's
    send; posted in one batch with the next receive (the runner's way) both complete."""
    schedule = reference_schedule("1f1b", stages, micro_batches)
    with pytest.raises(UnsafeOrder, match=r"stage 0 posts send F\d's activations to stage 1, "
                                          r"and only after it receive B0's gradient from stage 1"):
        simulate(schedule, micro_batches, posting="separate")
    simulate(schedule, micro_batches)  # fused, the default
    simulate(reference_schedule("gpipe", stages, micro_batches), micro_batches,
             posting="separate")  # GPipe's sends all come before its receives: safe either way


def test_pipeline_posts_fuse_a_send_with_the_next_receive_from_the_same_neighbour():
    fused = posts(reference_schedule("1f1b", 2, 2))
    assert fused[0] == [(Op("send", 1, "F0's activations"),),
                        (Op("send", 1, "F1's activations"), Op("recv", 1, "B0's gradient")),
                        (Op("recv", 1, "B1's gradient"),)]
    assert fused[1] == [(Op("recv", 0, "F0's activations"),),
                        (Op("send", 0, "B0's gradient"), Op("recv", 0, "F1's activations")),
                        (Op("send", 0, "B1's gradient"),)]
    separate = posts(reference_schedule("1f1b", 2, 2), fused=False)
    assert [len(post) for post in separate[0]] == [1, 1, 1, 1]


def test_pipeline_links_check_recorded_posts_and_a_send_nobody_receives():
    send, recv = Op("send", 1), Op("recv", 0)
    check_links([[(send,)], [(recv,)]])
    with pytest.raises(UnsafeOrder, match="never posts the other half"):
        check_links([[(send,), (send,)], [(recv,)]])
    crossed = [[(Op("send", 1),), (Op("recv", 1),)], [(Op("send", 0),), (Op("recv", 0),)]]
    with pytest.raises(UnsafeOrder, match="On NCCL"):
        check_links(crossed)
    check_links([[(Op("send", 1), Op("recv", 1))], [(Op("recv", 0), Op("send", 0))]])
    with pytest.raises(ValueError, match="posting"):
        simulate(reference_schedule("gpipe", 2, 2), 2, posting="batched")


@pytest.mark.parametrize("schedule,match", [
    ([[("F", 0)], [("F", 0), ("B", 0)]], r"stage 0 never runs \[\('B', 0\)\]"),
    ([[("F", 0), ("F", 0), ("B", 0)]], r"stage 0 runs \('F', 0\) twice"),
    ([[("B", 0), ("F", 0)]], r"before \('F', 0\)"),
    ([[("F", 0), ("B", 0), ("F", 1), ("B", 1)]], r"micro-batches 0 to 0"),
    ([[("X", 0)]], r"is not \('F', m\), \('B', m\) or \('W', m\)"),
    ([], r"at least one stage"),
], ids=["missing", "twice", "backward-first", "no-such-micro-batch", "unknown-kind", "empty"])
def test_pipeline_simulator_rejects_what_is_not_a_schedule(schedule, match):
    with pytest.raises(ScheduleError, match=match):
        simulate(schedule, 1)


def test_pipeline_timeline_draws_every_action():
    timeline = simulate(one_f_one_b(3, 4), 4)
    picture = ElementTree.fromstring(timeline.svg("1F1B, 3 stages, 4 micro-batches"))
    namespace = "{http://www.w3.org/2000/svg}"
    labels = [t.text for t in picture.iter(f"{namespace}text")]
    assert sum(label in {f"{k}{m}" for k in "FB" for m in range(4)} for label in labels) == 24
    assert "1F1B, 3 stages, 4 micro-batches" in labels and "stage 2" in labels
    assert "time (a forward = 1, a backward = 2)" in labels[-1], labels[-1]
    slower = simulate(one_f_one_b(3, 4), 4, forward_time=2.0, backward_time=3.0)
    assert "time (a forward = 2, a backward = 3)" in slower.svg()


def test_pipeline_pictures_in_the_docs_are_current():
    from lesson07 import simulator

    assert simulator.main(["--check"]) == 0, (
        "docs/assets/pipeline/ is stale: "
        "run `python lessons/07_pipeline_parallel/simulator.py --write`")


def test_pipeline_picture_check_can_fail(tmp_path, monkeypatch):
    from lesson07 import simulator

    monkeypatch.setattr(simulator, "PICTURES_DIR", tmp_path)
    assert simulator.main(["--check"]) == 1  # nothing drawn there yet
    simulator.main(["--write"])
    assert simulator.main(["--check"]) == 0
    (tmp_path / "gpipe.svg").write_text("<svg/>")
    assert simulator.main(["--check"]) == 1


# --------------------------------------------------------------------------- in_a_child


def child_answer(x: int) -> tuple[int, int]:
    return x * 2, os.getpid()


def child_raises() -> None:
    raise ValueError("raised in the child")


def child_sleeps(seconds: float) -> None:
    time.sleep(seconds)


def test_in_a_child_returns_raises_and_stops_what_hangs():
    from harness.ranks import in_a_child

    value, pid = in_a_child(child_answer, 21)
    assert value == 42 and pid != os.getpid(), "the call runs in another process"
    assert pid not in live_processes(), "the child exits after its call"
    with pytest.raises(RankError, match="ValueError.*raised in the child"):
        in_a_child(child_raises)
    with pytest.raises(RankTimeout, match="did not finish within 1 s"):
        in_a_child(child_sleeps, 60, timeout=1)
    children = [p for p, (parent, _) in live_processes().items() if parent == os.getpid()]
    assert not any("course-child" in open(f"/proc/{p}/comm").read() for p in children
                   if os.path.exists(f"/proc/{p}/comm")), "a child that hung is killed"
