"""Run a lesson script the way a learner does: plain ``python``, ``torchrun``, or the old
``python -m torch.distributed.launch``; with a timeout, and read back its machine-readable result.

    result = run_script("lessons/03_ddp/train_ddp.py", "--epochs", "2",
                        launcher="torchrun", nproc=2)
    result.data["train_loss"]  # what rank 0 wrote to the file passed as --result
    result.output              # stdout and stderr, each line tagged "[default<rank>]:" by torchrun

``start_script`` (same arguments) starts a script and returns at once, so that a test module
can start all its launches together and collect each with ``.result()``.

To call a script's ``main()`` in the test process instead, as plain ``python`` would run it,
use the ``outside_launcher`` fixture (the grading plugin provides it): no launcher variables in
the environment, and no process group left behind for the next test.

The script runs in its own process session, so a timeout kills the launcher and every rank it
started: nothing is left behind. ``torchrun --standalone`` picks a free port itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from harness.exercises import REPO_ROOT, TASK_ID, load_lesson_module
from harness.processes import descendants

# What torchrun (and torch.distributed.launch) sets for every rank.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT")

# The text a training run samples before and after training costs one forward a character (on
# several ranks, a collective or more each): a test's quick run asks for a few characters, the
# start of the full sample (lesson 00 checks that a shorter sample is a prefix of a longer one).
QUICK_SAMPLE_LENGTH = 8
QUICK_SAMPLE = ("--sample-length", str(QUICK_SAMPLE_LENGTH))


def one_process_fit(ctx, train_windows: int, batch_size: int = 16) -> dict:
    """The chain's reference run, on a pooled rank of a group of one: lesson 03's ``fit()``
    (DDP on one process, the data in one order), one epoch of the first ``train_windows``
    windows, sampling :data:`QUICK_SAMPLE_LENGTH` characters as the tests' launches do. Later
    lessons' scripts must take its steps. Returns its trained ``state`` (a plain
    GPT state dict) and its ``result``. Use it as ``run_on_ranks(one_process_fit, 64,
    world_size=1)``: a launch of its own would cost seconds."""
    train = load_lesson_module("03_ddp", "train_ddp")
    model, result = train.fit(ctx.device, epochs=1, batch_size=batch_size,
                              train_windows=train_windows, sample_length=QUICK_SAMPLE_LENGTH,
                              log=lambda *args, **kwargs: None)
    return {"state": model.state_dict(), "result": result}


@pytest.fixture
def outside_launcher(monkeypatch):
    """The environment of ``python script.py``: none of the launcher's variables; afterwards,
    no process group (a failed check must not leave one to the next test)."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _torchrun_command() -> list[str]:
    """The ``torchrun`` a learner types: the console script beside this Python, so that a broken
    one is caught; ``python -m torch.distributed.run`` (the same code) only where it is missing."""
    script = Path(sys.executable).with_name("torchrun")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "torch.distributed.run"]


LAUNCH_TIMEOUT = 120.0  # seconds; a launch takes 2-3 s on a 2-core CPU, ~15 s on a GPU machine

# --tee 3 tags every line of every rank with its local rank: "[default1]: ..."
LAUNCHERS = {
    "python": [sys.executable],
    "torchrun": [*_torchrun_command(), "--standalone", "--tee", "3"],
    # One node of several: the caller gives --nnodes and the rendezvous in launcher_args.
    "torchrun-node": [*_torchrun_command(), "--tee", "3"],
    # A shell script (a SLURM batch script, run by hand): it starts its launchers itself.
    "bash": ["bash"],
    "launch": [sys.executable, "-m", "torch.distributed.launch", "--standalone", "--tee", "3"],
}


def path_with(*folders: str | os.PathLike) -> str:
    """``PATH`` for a shell script a test runs (a batch script calls ``torchrun`` and
    ``python`` by name): ``folders`` first, then this interpreter's folder, whose ``torchrun``
    and ``python`` are the venv's whether or not it was activated, then the caller's ``PATH``."""
    here = str(Path(sys.executable).parent)  # not resolved: a venv's python is a link
    return os.pathsep.join([*map(str, folders), here, os.environ.get("PATH", "")])


def free_port() -> int:
    """A port the OS says is free now, for a rendezvous several launches must share (the
    caller's launches bind it right after; a single launch uses --standalone instead)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


CI_REPORTS_ENV = "COURSE_CI_REPORTS"  # where .ci/run keeps the whole course's JUnit reports
# In CI ($COURSE_CI_REPORTS set), every launch that ended leaves a line in this file there: the
# integrity tests then know which lesson scripts the lesson tests already ran, and how it ended.
LAUNCH_RECORD = "launches.jsonl"


def _launch_record() -> Path | None:
    """This CI run's record of launches, or None outside CI."""
    folder = os.environ.get(CI_REPORTS_ENV)
    return Path(folder) / LAUNCH_RECORD if folder else None


def _record_launch(script: Path, launcher: str, returncode: int) -> None:
    path = _launch_record()
    if path is None:
        return
    line = json.dumps({"script": script.relative_to(REPO_ROOT).as_posix()
                       if script.is_relative_to(REPO_ROOT) else str(script),
                       "launcher": launcher, "returncode": returncode})
    with open(path, "a") as record:  # one short write: lines stay whole
        record.write(line + "\n")


def recorded_launches() -> list[dict]:
    """What :func:`_record_launch` wrote in this CI run (empty outside CI)."""
    path = _launch_record()
    if path is None or not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class LaunchError(AssertionError):
    """The script exited with an error or ran past its timeout; the message has its output."""


@dataclasses.dataclass
class LaunchResult:
    command: list[str]
    returncode: int
    output: str
    data: dict | None  # the JSON the script wrote to --result, if asked for

    def rank_lines(self, rank: int) -> list[str]:
        """The output lines torchrun tagged with ``rank`` (tag removed)."""
        tag = f"[default{rank}]:"
        return [line[len(tag):] for line in self.output.splitlines() if line.startswith(tag)]


class Launch:
    """A script started in the background: ``.result()`` waits for it (within its timeout).

    Most of a launch is Python importing torch, which overlaps well even on two cores, so a
    test module can start its launches together and collect them one by one.
    """

    def __init__(self, script: str | os.PathLike, *args: str, launcher: str = "python",
                 nproc: int = 1, result: bool = True, timeout: float = LAUNCH_TIMEOUT,
                 env: dict | None = None, check: bool = True, launcher_args: tuple = ()):
        if launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {sorted(LAUNCHERS)}, not {launcher!r}")
        script = Path(script)
        if not script.is_absolute():
            script = REPO_ROOT / script
        self.script, self.launcher = script, launcher
        command = [*LAUNCHERS[launcher], *launcher_args]  # e.g. ("--max-restarts=1",)
        if launcher not in ("python", "bash"):
            command.append(f"--nproc-per-node={nproc}")
        command += [str(script), *args]
        self._tmp = tempfile.TemporaryDirectory(prefix="course-launch-")
        self._result_path = Path(self._tmp.name) / "result.json" if result else None
        if self._result_path:
            command += ["--result", str(self._result_path)]
        self.command, self.timeout, self.check = command, timeout, check
        self._deadline = time.monotonic() + timeout
        self._log = open(Path(self._tmp.name) / "output.txt", "w+")  # a pipe could fill up
        child_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                     **({"PATH": path_with()} if launcher == "bash" else {}), **(env or {})}
        self._proc = subprocess.Popen(command, cwd=REPO_ROOT, env=child_env, stdout=self._log,
                                      stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True)
        self._outcome: LaunchResult | BaseException | None = None

    @property
    def pid(self) -> int:
        """The launcher's process id: torchrun's agent, for a torchrun launch."""
        return self._proc.pid

    def running(self) -> bool:
        return self._proc.poll() is None

    def output_so_far(self) -> str:
        """What the launch has printed until now (it may still be running)."""
        if self._outcome is not None:
            return self._outcome.output if isinstance(self._outcome, LaunchResult) else ""
        return (Path(self._tmp.name) / "output.txt").read_text(errors="replace")

    def result(self) -> LaunchResult:
        """Wait for the script; raise LaunchError if it failed or ran past its timeout."""
        if self._outcome is None:
            try:
                self._outcome = self._finish()
            except BaseException as exc:
                self._outcome = exc
                if not isinstance(exc, (LaunchError, NotImplementedError)):
                    raise  # Ctrl-C or pytest-timeout: don't remember it
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome

    def _finish(self) -> LaunchResult:
        try:
            self._proc.wait(timeout=max(0.0, self._deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            raise LaunchError(
                f"{_show(self.command)} ran past its {self.timeout:.0f} s timeout (a hang?) "
                f"and was stopped. Its output:\n{self._read_output()}"
            ) from None
        except BaseException:
            self.stop()  # take every rank down with us
            raise
        output = self._read_output()
        path = self._result_path
        data = json.loads(path.read_text()) if path and path.exists() else None
        self._tmp.cleanup()
        _record_launch(self.script, self.launcher, self._proc.returncode)
        outcome = LaunchResult(self.command, self._proc.returncode, output, data)
        if self.check and self._proc.returncode != 0:
            stub = _STUB_IN_OUTPUT.search(output)
            if stub:  # an untouched exercise reached inside a launched rank: "not attempted"
                raise NotImplementedError(f"{stub.group(1)} (reached in a launched process)")
            raise LaunchError(
                f"{_show(self.command)} exited with {self._proc.returncode}. "
                f"Its output:\n{output}"
            )
        if self.check and path and data is None:
            raise LaunchError(f"{_show(self.command)} wrote no result file. Its output:\n{output}")
        return outcome

    def _read_output(self) -> str:
        self._log.seek(0)
        output = self._log.read()
        self._log.close()
        return output

    def stop(self) -> None:
        """Kill the launcher and every process it started.

        torchrun starts each rank in a session of its own, so killing the launcher's process
        group is not enough: freeze the launcher (it cannot start or restart ranks then), kill
        every descendant, then the launcher."""
        if self._proc.poll() is not None:
            return
        try:
            os.kill(self._proc.pid, signal.SIGSTOP)
        except ProcessLookupError:
            return
        for pid in [*descendants(self._proc.pid), self._proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._proc.wait()


def start_script(script: str | os.PathLike, *args: str, **options) -> Launch:
    """Start ``script`` now and return at once; see :class:`Launch` and :func:`run_script`."""
    return Launch(script, *args, **options)


def start_nodes(script: str | os.PathLike, *args: str, nodes: int = 2, nproc: int = 1,
                job: str = "nodes", timeout: float = LAUNCH_TIMEOUT, check: bool = True,
                env: dict | None = None, min_nodes: int | None = None,
                rdzv_conf: dict | None = None, launcher_args: tuple = ()) -> list[Launch]:
    """``nodes`` torchrun agents on this machine, started as the nodes of one job of ``nproc``
    processes each, on a c10d rendezvous at a free port of 127.0.0.1. Node n's agent says it is
    127.0.0.(n + 1) (every 127.x address is this machine): the rendezvous numbers the nodes in
    the order of their addresses (then of their process ids), so node n is GROUP_RANK n, and
    node 0 has the job's rank 0, whose launch alone asks for ``--result``. Node 0's agent hosts
    the rendezvous's store (``is_host`` pins it: on one machine any agent could).

    With ``min_nodes``, the job is elastic (``--nnodes=min_nodes:nodes``); ``rdzv_conf`` adds
    to ``--rdzv-conf`` (``{"last_call_timeout": 5}``), ``launcher_args`` to each torchrun."""
    if not 1 <= nodes <= 9:  # "127.0.0.10" would sort before "127.0.0.2"
        raise ValueError(f"1 to 9 nodes, not {nodes}")
    port = free_port()
    nnodes = f"{min_nodes}:{nodes}" if min_nodes is not None else f"{nodes}"
    conf = ",".join(f"{key}={value}" for key, value in (rdzv_conf or {}).items())
    return [Launch(script, *args, launcher="torchrun-node", nproc=nproc, result=node == 0,
                   timeout=timeout, check=check, env=env, launcher_args=(
                       f"--nnodes={nnodes}", "--rdzv-backend=c10d",
                       f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={job}",
                       f"--rdzv-conf=is_host={node == 0}" + (f",{conf}" if conf else ""),
                       f"--local-addr=127.0.0.{node + 1}", *launcher_args))
            for node in range(nodes)]


def run_script(script: str | os.PathLike, *args: str, launcher: str = "python", nproc: int = 1,
               result: bool = True, timeout: float = LAUNCH_TIMEOUT, env: dict | None = None,
               check: bool = True, launcher_args: tuple = ()) -> LaunchResult:
    """Run ``script`` with ``launcher`` (a key of ``LAUNCHERS``) on ``nproc`` ranks;
    ``launcher_args`` go to the launcher (``("--max-restarts=1",)``).

    With ``result=True`` the script gets ``--result <file>`` and the JSON it writes there is
    returned in ``.data``. With ``check=True`` a non-zero exit raises :class:`LaunchError`
    (or ``NotImplementedError`` when an untouched exercise stub stopped it).
    """
    return Launch(script, *args, launcher=launcher, nproc=nproc, result=result,
                  timeout=timeout, env=env, check=check, launcher_args=launcher_args).result()


_STUB_IN_OUTPUT = re.compile(r"NotImplementedError: (" + TASK_ID.pattern + r"[^\n]*)")


def _show(command: list[str]) -> str:
    names = {LAUNCHERS["torchrun"][0]: "torchrun", sys.executable: "python"}
    shown = [names.get(part, part) for part in command]
    return " ".join(str(Path(p).relative_to(REPO_ROOT)) if p.startswith(str(REPO_ROOT)) else p
                    for p in shown)


# (fixture, lesson folder) of every fixture start_first starts: each launches scripts.
LAUNCHING: dict[tuple[str, Path], None] = {}


def _uses(item, fixture: str, folder: Path) -> bool:
    return fixture in item.fixturenames and folder in Path(item.path).resolve().parents


def unmarked_launch_users(items) -> list[str]:
    """The selected tests that wait on a launching fixture (see :func:`start_first`) without
    the ``slow`` mark: ``pytest -m "not slow"`` promises to start no script, and would."""
    return [item.nodeid for item in items
            if item.get_closest_marker("slow") is None
            and any(_uses(item, fixture, folder) for fixture, folder in LAUNCHING)]


def start_first(fixture: str, conftest: str):
    """An autouse fixture for a lesson's ``conftest.py``: when a selected test of the lesson
    uses ``fixture`` (a session-scoped fixture of that conftest that starts scripts in the
    background, as :func:`start_script` does), it is set up before the lesson's first test,
    not the first test that needs it, so the scripts' seconds of importing torch overlap the
    lesson's other checks, in every test file of the folder. The conftest writes
    ``start_launches_first = start_first("launches", __file__)``."""
    folder = Path(conftest).resolve().parent
    LAUNCHING[fixture, folder] = None

    @pytest.fixture(scope="session", autouse=True, name=f"start_{fixture}_first")
    def start(request):
        if any(_uses(item, fixture, folder) for item in request.session.items):
            request.getfixturevalue(fixture)

    return start
