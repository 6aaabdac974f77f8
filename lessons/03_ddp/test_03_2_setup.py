"""Grades task3_2, setup: read the launcher's variables, pick the backend and the device, and join
the process group, first with CUDA and the process group faked, then under the real torchrun.

    pytest lessons/03_ddp -m task3_2
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from harness.exercises import load_exercise, raise_if_untouched
from harness.launch import start_script
from lesson03.common import LESSON

# This task's contract, clause by clause, and the tests that fail when only that clause
# is broken (tests/test_course.py checks the names).
CLAUSES = {
    "task3_2": {
        "read RANK, LOCAL_RANK, WORLD_SIZE": [
            "test_setup_sets_the_device_before_joining_with_a_timeout"],
        "LOCAL_WORLD_SIZE, default: WORLD_SIZE": [
            "test_setup_local_world_size_defaults_to_world_size"],
        "none of the five launcher variables set: RuntimeError saying to launch with torchrun": [
            "test_setup_rejects_bad_environments"],
        "only some set: RuntimeError naming the missing ones": [
            "test_setup_rejects_bad_environments"],
        "backend auto: nccl when CUDA has at least LOCAL_WORLD_SIZE GPUs, else gloo": [
            "test_setup_sets_the_device_before_joining_with_a_timeout",
            "test_setup_auto_uses_gloo_with_fewer_gpus_than_local_ranks",
            "test_setup_auto_uses_gloo_without_a_gpu",
            "test_setup_uses_nccl_on_a_one_gpu_machine"],
        "nccl with no GPU, or fewer than LOCAL_WORLD_SIZE: RuntimeError, before touching CUDA": [
            "test_setup_refuses_nccl_without_enough_gpus",
            "test_setup_rejects_bad_environments"],
        "with nccl, torch.cuda.set_device(local_rank) before init_process_group": [
            "test_setup_sets_the_device_before_joining_with_a_timeout"],
        "the device is cuda:<local_rank> with nccl, the CPU with gloo": [
            "test_setup_sets_the_device_before_joining_with_a_timeout",
            "test_setup_auto_uses_gloo_with_fewer_gpus_than_local_ranks"],
        "init_process_group(backend, init_method='env://', ...)": [
            "test_setup_sets_the_device_before_joining_with_a_timeout"],
        "a timeout under a minute": [
            "test_setup_sets_the_device_before_joining_with_a_timeout"],
    },
}


# On a CPU-only machine torchrun never exercises the NCCL path, and on one machine RANK equals
# LOCAL_RANK. So the test below also runs setup in this process with CUDA and the
# process group faked: process 3 of a job of 2 machines x 2 GPUs (its LOCAL_RANK is 1), and
# records what it asks for and in which order. Nothing real is initialised. These checks
# come before the torchrun ones: a mistake they catch is reported in a second, not after a launch.
SECOND_MACHINE = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # never contacted
MAX_INIT_TIMEOUT = 60.0  # seconds: "a timeout under a minute"


def _device_index(device) -> int | str:
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device) and device.index is not None:
        return device.index
    return repr(device)


def init_with_fakes(ex, monkeypatch, env: dict, gpus: int, backend: str,
                    calls: list | None = None):
    """Call ``ex.setup(backend)`` with ``gpus`` fake GPUs and a fake process group;
    return (what it returned, the calls it made in order). The calls also go into ``calls``
    when given, so that they can be read after setup raised."""
    calls = [] if calls is None else calls
    state = {"initialized": False, "device": 0, "backend": None}

    def set_device(device):
        calls.append(("set_device", _device_index(device)))
        state["device"] = _device_index(device)

    def init_process_group(backend=None, init_method=None, timeout=None, **kwargs):
        calls.append(("init_process_group", backend, timeout,
                      {"init_method": init_method, **kwargs}))
        state["initialized"], state["backend"] = True, backend

    fakes = {
        (torch.cuda, "is_available"): lambda: gpus > 0,
        (torch.cuda, "device_count"): lambda: gpus,
        (torch.cuda, "set_device"): set_device,
        (torch.cuda, "current_device"): lambda: state["device"],
        (dist, "init_process_group"): init_process_group,
        (dist, "is_initialized"): lambda: state["initialized"],
        (dist, "get_rank"): lambda group=None: int(env["RANK"]),
        (dist, "get_world_size"): lambda group=None: int(env["WORLD_SIZE"]),
        (dist, "get_backend"): lambda group=None: state["backend"],
        (dist, "barrier"): lambda *args, **kwargs: calls.append(("barrier",)),
    }
    for (owner, name), fake in fakes.items():
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, fake)
        for attribute, value in list(vars(ex).items()):  # `from ... import name` too
            if value is real:
                monkeypatch.setattr(ex, attribute, fake)
    monkeypatch.setattr(torch.distributed.distributed_c10d, "init_process_group",
                        init_process_group)
    for name in (*ex.LAUNCHER_VARIABLES, "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        return ex.setup(backend), calls
    finally:
        monkeypatch.undo()


@pytest.mark.task3_2
@pytest.mark.parametrize("backend", ["nccl", "auto"])
def test_setup_sets_the_device_before_joining_with_a_timeout(ex, monkeypatch, backend):
    """setup('nccl') and setup('auto') as RANK 3, LOCAL_RANK 1 of 2 machines x 2 GPUs (CUDA and the
    group faked) return ranks, world sizes, nccl and cuda:1, and call set_device(1) once, before
    one init_process_group: nccl, env:// (or no init_method), a timedelta timeout of at most 60 s.
    """
    where = (f"setup({backend!r}) as process RANK=3, LOCAL_RANK=1 of 2 machines x 2 GPUs "
             f"(CUDA faked)")
    try:
        info, calls = init_with_fakes(ex, monkeypatch, SECOND_MACHINE, 2, backend)
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the learner's error is the finding
        raise AssertionError(f"{where} raised {type(error).__name__}: {error}") from None
    expected = {"rank": 3, "local_rank": 1, "world_size": 4, "local_world_size": 2,
                "backend": "nccl", "device": torch.device("cuda", 1)}
    for field, value in expected.items():
        got = getattr(info, field)
        assert got == value, (
            f"{where}: {field} is {got!r}, expected {value!r}"
            + (": the GPU index is LOCAL_RANK, not RANK" if field in ("local_rank", "device")
               else ""))
    devices = [call[1] for call in calls if call[0] == "set_device"]
    inits = [i for i, call in enumerate(calls) if call[0] == "init_process_group"]
    assert len(inits) == 1, f"{where}: init_process_group was called {len(inits)} times, not once"
    assert devices, (f"{where}: torch.cuda.set_device was never called: call "
                     f"torch.cuda.set_device(local_rank) before init_process_group")
    assert len(devices) == 1, (
        f"{where}: torch.cuda.set_device was called {len(devices)} times ({devices}): call it "
        f"once, with LOCAL_RANK")
    assert devices == [1], (
        f"{where}: torch.cuda.set_device({devices[0]}) was called: the GPU index is LOCAL_RANK "
        f"(1), not RANK (3)")
    first_set = next(i for i, call in enumerate(calls) if call[0] == "set_device")
    assert first_set < inits[0], (
        f"{where}: torch.cuda.set_device(1) was called after init_process_group: set the device "
        f"first, so that everything the process group sets up for this process (NCCL's "
        f"communicator, a barrier) uses its own GPU, not cuda:0")
    _, used_backend, timeout, options = calls[inits[0]]
    assert used_backend == "nccl", f"{where}: init_process_group got backend {used_backend!r}"
    assert options["init_method"] in (None, "env://"), (
        f"{where}: init_process_group got init_method={options['init_method']!r}: torchrun "
        f"describes the rendezvous in the environment, so pass init_method='env://'")
    assert timeout is not None, (
        f"{where}: init_process_group was called without timeout=: a missing peer then hangs "
        f"for the default timeout (10 minutes with NCCL, 30 with gloo) instead of failing; pass "
        f"timeout=datetime.timedelta(seconds=30)")
    assert isinstance(timeout, datetime.timedelta), (
        f"{where}: timeout={timeout!r}: pass a datetime.timedelta")
    assert 0 < timeout.total_seconds() <= MAX_INIT_TIMEOUT, (
        f"{where}: timeout={timeout}: keep it under a minute, so that a missing peer becomes an "
        f"error quickly")


@pytest.mark.task3_2
def test_setup_auto_uses_gloo_with_fewer_gpus_than_local_ranks(ex, monkeypatch):
    """setup('auto') with 2 local ranks and 1 GPU (faked) returns gloo on the CPU, joins the group
    with gloo and never calls set_device."""
    where = "setup('auto') with 2 processes on this machine and 1 GPU (CUDA faked)"
    try:
        info, calls = init_with_fakes(ex, monkeypatch, SECOND_MACHINE, 1, "auto")
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the learner's error is the finding
        raise AssertionError(
            f"{where} raised {type(error).__name__}: {error}. 'auto' should choose gloo here: "
            f"compare torch.cuda.device_count() with LOCAL_WORLD_SIZE") from None
    assert (info.backend, info.device) == ("gloo", torch.device("cpu")), (
        f"{where} returned backend {info.backend!r} on {info.device}: 'auto' should choose gloo "
        f"on the CPU: compare torch.cuda.device_count() with LOCAL_WORLD_SIZE")
    assert not [call for call in calls if call[0] == "set_device"], (
        f"{where}: gloo on the CPU should not call torch.cuda.set_device")
    inits = [call for call in calls if call[0] == "init_process_group"]
    assert inits and inits[0][1] == "gloo", f"{where}: init_process_group calls: {inits}"


def init_failure(ex, monkeypatch, env, gpus, backend, where):
    """Run init_with_fakes; a learner's unexpected error becomes the finding."""
    try:
        return init_with_fakes(ex, monkeypatch, env, gpus, backend)
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the learner's error is the finding
        raise AssertionError(f"{where} raised {type(error).__name__}: {error}") from None


@pytest.mark.task3_2
def test_setup_auto_uses_gloo_without_a_gpu(ex, monkeypatch):
    """setup('auto') as the only process on a machine without a GPU (faked) returns gloo on the CPU
    and never calls set_device."""
    env = {**SECOND_MACHINE, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1"}
    where = "setup('auto') as the only process on a machine without a GPU (CUDA faked)"
    info, calls = init_failure(ex, monkeypatch, env, 0, "auto", where)
    assert (info.backend, info.device) == ("gloo", torch.device("cpu")), (
        f"{where} returned backend {info.backend!r} on {info.device}: with no GPU, 'auto' is "
        f"gloo on the CPU (count 0 GPUs when torch.cuda.is_available() is False)")
    assert not [call for call in calls if call[0] == "set_device"], (
        f"{where}: gloo on the CPU should not call torch.cuda.set_device")


@pytest.mark.task3_2
@pytest.mark.parametrize("backend", ["nccl", "auto"])
def test_setup_uses_nccl_on_a_one_gpu_machine(ex, monkeypatch, backend):
    """setup('nccl') and setup('auto') as the only process on a machine with 1 GPU (faked) return
    nccl on cuda:0 and call set_device(0), once."""
    env = {**SECOND_MACHINE, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1"}
    where = f"setup({backend!r}) as the only process on a machine with 1 GPU (CUDA faked)"
    info, calls = init_failure(ex, monkeypatch, env, 1, backend, where)
    assert (info.backend, info.device) == ("nccl", torch.device("cuda", 0)), (
        f"{where} returned backend {info.backend!r} on {info.device}: one GPU is enough for one "
        f"local process: nccl on cuda:0")
    assert [call[1] for call in calls if call[0] == "set_device"] == [0], (
        f"{where}: expected torch.cuda.set_device(0) before init_process_group; calls: {calls}")


@pytest.mark.task3_2
def test_setup_local_world_size_defaults_to_world_size(ex, monkeypatch):
    """Without LOCAL_WORLD_SIZE, setup('auto') as RANK 3 of WORLD_SIZE 4 with 2 GPUs (faked) takes a
    local world size of 4, and so returns gloo on the CPU."""
    env = {name: value for name, value in SECOND_MACHINE.items() if name != "LOCAL_WORLD_SIZE"}
    where = ("setup('auto') as RANK=3 of WORLD_SIZE=4 with LOCAL_WORLD_SIZE unset and 2 "
             "GPUs (CUDA faked)")
    info, calls = init_failure(ex, monkeypatch, env, 2, "auto", where)
    assert info.local_world_size == 4, (
        f"{where}: local_world_size is {info.local_world_size!r}, expected 4: without "
        f"LOCAL_WORLD_SIZE, take WORLD_SIZE (all the processes on one machine)")
    assert (info.backend, info.device) == ("gloo", torch.device("cpu")), (
        f"{where} returned backend {info.backend!r} on {info.device}: 4 local processes and 2 "
        f"GPUs: 'auto' is gloo (LOCAL_WORLD_SIZE defaults to WORLD_SIZE)")


@pytest.mark.task3_2
@pytest.mark.parametrize("gpus", [0, 1], ids=["no GPU", "1 GPU for 2 local ranks"])
def test_setup_refuses_nccl_without_enough_gpus(ex, monkeypatch, gpus):
    """setup('nccl') for 2 local ranks with 0 GPUs, and with 1 GPU (faked), raises a RuntimeError
    that mentions GPUs, before calling set_device or init_process_group."""
    where = (f"setup('nccl') with 2 processes on this machine and {gpus} GPU(s) "
             f"(CUDA faked)")
    calls = []
    try:
        got, _ = init_with_fakes(ex, monkeypatch, SECOND_MACHINE, gpus, "nccl", calls)
    except NotImplementedError:
        raise
    except RuntimeError as error:
        message = str(error)
    except Exception as error:  # noqa: BLE001 - the learner's error is the finding
        pytest.fail(f"{where} raised {type(error).__name__}: {error}; expected a RuntimeError "
                    f"saying nccl needs one GPU per local rank")
    else:
        pytest.fail(f"{where} returned {got!r} after the calls {calls}; expected a RuntimeError, "
                    f"before anything touches CUDA: nccl needs one GPU per local rank")
    assert "GPU" in message, (
        f"{where}: the RuntimeError should say what is missing (GPUs): {message}")
    touched = [call[0] for call in calls if call[0] in ("set_device", "init_process_group")]
    assert not touched, (
        f"{where}: the RuntimeError came after {' and '.join(touched)}: check the GPUs first and "
        f"raise before anything touches CUDA (on a machine without enough GPUs, "
        f"torch.cuda.set_device itself fails, with a less helpful error)")


CHECK_INIT = "lessons/03_ddp/check_setup.py"  # runs setup under torchrun


@pytest.fixture(scope="module")
def init_checks():
    """Both launches of the init check, started together (not at all for the untouched stub)."""
    raise_if_untouched(load_exercise(LESSON).setup)
    return {"torchrun": start_script(CHECK_INIT, launcher="torchrun", nproc=2),
            "bad environments": start_script(CHECK_INIT, "--bad-environments", timeout=60)}


@pytest.mark.slow
@pytest.mark.task3_2
def test_setup_under_torchrun(init_checks):
    """Under real torchrun with 2 processes (check_setup.py), setup returns each rank's rank, local
    rank, world sizes of 2, backend and device (nccl on cuda:rank with 2 GPUs, else gloo on the
    CPU), and the group it joined all-reduces 1 + 2 = 3."""
    run = init_checks["torchrun"].result()
    gpus = torch.cuda.device_count()
    backend = "nccl" if gpus >= 2 else "gloo"
    for rank, info in enumerate(run.data["ranks"]):
        expected = {"rank": rank, "local_rank": rank, "world_size": 2, "local_world_size": 2,
                    "backend": backend,
                    "device": f"cuda:{rank}" if backend == "nccl" else "cpu"}
        for field, value in expected.items():
            assert info[field] == value, f"rank {rank}: {field} is {info[field]!r}, not {value!r}"
        assert info["backend_in_use"] == backend, f"rank {rank}: the group uses the wrong backend"
        assert info["all_reduce"] == 3.0, f"rank {rank}: the group does not work"
        if backend == "nccl":
            assert info["current_cuda_device"] == rank, f"rank {rank}: set_device was not called"


@pytest.mark.slow
@pytest.mark.task3_2
def test_setup_rejects_bad_environments(init_checks):
    """setup raises a RuntimeError naming torchrun without a launcher; LOCAL_RANK, MASTER_ADDR and
    MASTER_PORT when only RANK and WORLD_SIZE are set; GPU for nccl with no GPU or with 2 local
    ranks and 1 GPU (faked); and joins a group for a complete world of one.

    check_setup.py --bad-environments runs the cases one after another, in a process of its own,
    outside any launcher; without CUDA, the world of one must be gloo on the CPU."""
    run = init_checks["bad environments"].result()
    expectations = {
        "no launcher": ["torchrun"],
        "only RANK and WORLD_SIZE": ["LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"],
        "nccl without a GPU": ["GPU"],
        "nccl with 2 local ranks and 1 GPU": ["GPU"],
    }
    for case, words in expectations.items():
        outcome = run.data[case]
        assert outcome.get("error") == "RuntimeError", (
            f"{case}: expected a RuntimeError naming {words}, got {outcome}"
        )
        missing = [w for w in words if w not in outcome["message"]]
        assert not missing, f"{case}: the error should mention {missing}: {outcome['message']!r}"
    ok = run.data["auto on this machine, world of one"]
    assert "returned" in ok, f"a complete environment must work, got {ok}"
    assert ok["returned"]["world_size"] == "1" and ok["group"], ok
    if not torch.cuda.is_available():
        assert ok["returned"]["backend"] == "gloo" and ok["returned"]["device"] == "cpu", ok
