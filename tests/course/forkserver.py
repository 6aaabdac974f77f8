"""Run pytest many times without paying for torch's import each time.

The integrity suite grades a hundred scratch copies of the course, one ``pytest`` run each. A
fresh interpreter spends seconds importing torch (about 3.5 s for the CUDA build on a 2-core
machine) before its first test: most of each run. Here a server process imports torch and pytest
once and forks a child for each run. The child starts with them already imported, moves into the
run's folder, takes the run's environment and calls ``pytest.main`` there.

The server imports nothing of the course, so each child imports the ``harness``, lessons and
exercises of the folder it runs in (a scratch copy has its own). The child runs in a session of
its own: when its time is up, every process still in that session is killed with it. (A script
started by ``harness.launch`` has a session of its own and is stopped by the test that started
it; pytest-timeout ends a stuck test, teardown included, long before the run's own limit.)

    rc, output = run_pytest(["lessons/00_single_gpu", "-q"], cwd=root, env=env, timeout=300)
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# What run_pytest returns as the exit status of a run killed at its timeout: not a status a
# process can end with (0 to 255, or minus a signal's number).
TIMED_OUT = -1000

_SERVER = r"""
import atexit, json, os, signal, sys, threading, time, traceback
# The expensive imports, once. Nothing of the course: children import their own copy of it.
import torch, torch.distributed, torch.multiprocessing, torch.nn, torch.utils.data  # noqa
# What lessons 05, 06 and 09 load on top (FSDP's first call imports torch._dynamo): seconds a run.
import torch._dynamo, torch.distributed.checkpoint, torch.distributed.fsdp  # noqa
import torch.distributed.tensor.parallel  # noqa
import pytest

for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            os.setsid()  # a group of its own: killed with everything it starts
            os.chdir(job["cwd"])
            os.environ.clear()
            os.environ.update(job["env"])
            log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(log, 1)
            os.dup2(log, 2)
            sys.argv = ["pytest", *job["args"]]
            code = int(pytest.main(job["args"]))
        except BaseException:
            traceback.print_exc()
        finally:
            # What the end of a normal interpreter does, which os._exit skips: wait for
            # non-daemon threads, then run the atexit handlers (the rank pools' close_all
            # stops and reaps their workers, multiprocessing reaps its children).
            try:
                threading._shutdown()
                atexit._run_exitfuncs()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
    deadline = time.monotonic() + job["timeout"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            code = TIMED_OUT
            break
        time.sleep(0.02)
    print(json.dumps({"code": code}), flush=True)
""".replace("TIMED_OUT", str(TIMED_OUT))


class _Server:
    def __init__(self) -> None:
        # The server's own environment only matters for importing torch; each run gets its own.
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, cwd=tempfile.gettempdir())

    def run(self, args: list[str], cwd: Path, env: dict, timeout: float) -> tuple[int, str]:
        with tempfile.NamedTemporaryFile("r", suffix=".log", delete=False) as log:
            path = log.name
        try:
            job = {"args": args, "cwd": str(cwd), "env": env, "timeout": timeout, "log": path}
            self.process.stdin.write(json.dumps(job) + "\n")
            self.process.stdin.flush()
            reply = self.process.stdout.readline()
            if not reply:
                raise RuntimeError(f"the pytest fork server exited ({self.process.poll()})")
            return json.loads(reply)["code"], Path(path).read_text(errors="replace")
        except BaseException:
            # Interrupted or broken mid-job: its reply would be read as the next job's. This
            # server is done; the next run on this thread starts a new one.
            self.process.kill()
            self.process.wait()
            raise
        finally:
            os.unlink(path)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()  # the server's loop ends at end of input
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


_local = threading.local()  # one server per thread: each runs one job at a time
_servers: list[_Server] = []
_lock = threading.Lock()


def _server() -> _Server:
    server = getattr(_local, "server", None)
    if server is None or server.process.poll() is not None:
        server = _local.server = _Server()
        with _lock:
            _servers.append(server)
    return server


@atexit.register
def close_all() -> None:
    with _lock:
        for server in _servers:
            server.close()
        _servers.clear()


def server_pids() -> set[int]:
    """The PIDs of this process's fork servers (children of it that live until it exits)."""
    with _lock:
        return {server.process.pid for server in _servers if server.process.poll() is None}


def available() -> bool:
    """Forking is POSIX-only; elsewhere callers start a fresh interpreter per run."""
    return hasattr(os, "fork")


def run_pytest(args: list[str], cwd: Path, env: dict, timeout: float) -> tuple[int, str]:
    """``pytest.main(args)`` in a forked child in ``cwd`` with ``env``; its exit status
    (``TIMED_OUT`` when it was killed at ``timeout`` seconds) and everything it printed."""
    return _server().run(list(args), Path(cwd), dict(env), timeout)
