"""Run a function on N ranks through a pool of worker processes that is started once and reused.

Starting N fresh processes (and a process group) for every check costs seconds on a small
machine; a pool pays that once and then costs milliseconds per check::

    from harness.ranks import run_on_ranks

    def check(ctx, scale):                      # module level, so every rank can find it
        t = torch.ones(2, device=ctx.device) * (ctx.rank + 1) * scale
        dist.all_reduce(t)
        return t

    results = run_on_ranks(check, 3.0, world_size=2)   # [rank 0's result, rank 1's result]

How it stays bounded and clean:

- rendezvous through a FileStore in a fresh temporary directory: no port at all;
- the process group has a timeout (``PG_TIMEOUT``), every call has one (``timeout=``);
- a rank's exception comes back with its traceback, tagged with the rank; the pool is then
  rebuilt, since the other ranks may be stuck in a collective;
- workers die with the parent (``PR_SET_PDEATHSIG`` on Linux) and are killed on timeout, on
  Ctrl-C and at exit: no orphans;
- CPU pools fork (fast) unless this process has initialised CUDA; CUDA pools spawn.

``in_a_child(fn, *args)`` runs one call, ``fn(*args)`` (no ``ctx``, no process group), in a
fresh process of its own, with the same bounds: for a call that must own the default process
group (torch's fake one, which plays any rank of any world size) or that would leave this
process unfit to fork ranks from.

The function runs as ``fn(ctx, *args, **kwargs)`` where ``ctx`` is a :class:`RankContext`. It is
sent by file path and name, not pickled, so it must be defined at module level; arguments and
results are pickled (tensors in results are moved to the CPU first).
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import datetime
import importlib
import multiprocessing as mp
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection, wait

import pytest
import torch
import torch.distributed as dist

from harness.exercises import task_of
from harness.hardware import cuda_device_count, gpu_marks, gpu_skip_reason

_LESSON_MODULE = re.compile(r"lesson\d\d(\.\w+)+")  # a lesson's module, see harness/__init__.py

PG_TIMEOUT = 20.0  # seconds after which a stuck collective raises on its rank
CALL_TIMEOUT = 40.0  # seconds the parent waits for all ranks to answer one call
START_TIMEOUT = 60.0  # seconds for the workers to start and join the process group
GRACE = 3.0  # after one rank fails, how long to wait for the others' own errors


@dataclasses.dataclass(frozen=True)
class RankContext:
    """What a function running on a rank knows about its place in the group."""

    rank: int
    world_size: int
    backend: str
    device: torch.device

    @property
    def local_rank(self) -> int:  # every pool lives on one machine
        return self.rank


class RankError(AssertionError):
    """A rank raised; the message carries its rank-tagged traceback."""


class NotAttemptedOnRank(NotImplementedError):
    """An untouched exercise stub was reached inside a rank (reported as "not attempted")."""


class RankTimeout(RankError):
    """Some ranks did not answer within the call's timeout (a hang, turned into an error)."""


# ----------------------------------------------------------------------------- worker side


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: killed when the parent dies
        if os.getppid() == 1:  # parent already gone before prctl took effect
            os._exit(1)


def _find_function(path: str, module_name: str, qualname: str):
    """The function the parent named: from a module already imported from ``path``, else
    imported by its name when that is a lesson's own module (``lesson07.common``: one copy
    in this process, whoever imports it), else loaded by path (a test file)."""
    for module in list(sys.modules.values()):
        if getattr(module, "__file__", None) == path:
            break
    else:
        if _LESSON_MODULE.fullmatch(module_name):
            module = importlib.import_module(module_name)
        else:
            from harness.exercises import load_path

            module = load_path(path)
    target = module
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def _call_and_reply(conn: Connection, path, module_name, qualname, args, kwargs) -> None:
    """Call the function the parent named and send back its result, or the error it raised."""
    try:
        reply = ("ok", _to_cpu(_find_function(path, module_name, qualname)(*args, **kwargs)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        reply = ("error", _describe(exc))
    try:
        payload = pickle.dumps(reply)
    except Exception as exc:  # noqa: BLE001
        payload = pickle.dumps(("error", _describe(exc, "the result cannot be pickled")))
    conn.send_bytes(payload)


def _worker_main(rank, world_size, backend, device_kind, store_path, pg_timeout,
                 conn: Connection):
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends a worker at once
    torch.set_num_threads(1)  # N ranks share a few cores; oversubscription only slows them
    try:
        if device_kind == "cuda":
            index = rank if backend == "nccl" else 0  # gloo ranks may share cuda:0
            torch.cuda.set_device(index)
            device = torch.device("cuda", index)
        else:
            device = torch.device("cpu")
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        ctx = RankContext(rank, world_size, backend, device)
        conn.send_bytes(pickle.dumps(("ready", None)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send_bytes(pickle.dumps(("error", _describe(exc))))
        return
    try:
        while True:
            try:
                message = conn.recv_bytes()
            except EOFError:
                return
            if not message:  # the parent's "stop"
                return
            path, module_name, qualname, args, kwargs = pickle.loads(message)
            _call_and_reply(conn, path, module_name, qualname, (ctx, *args), kwargs)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _describe(exc: BaseException, context: str = "") -> dict:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "type": type(exc).__name__,
        "message": (f"{context}: " if context else "") + str(exc),
        "traceback": text,
        "task": task_of(exc),
    }


# ----------------------------------------------------------------------------- parent side


def _default_start_method(device: str) -> str:
    """fork starts a CPU pool in milliseconds, but CUDA cannot survive a fork: CUDA pools
    spawn, and so does a CPU pool once this process has initialised CUDA itself (an earlier
    GPU test), since its forked children would inherit a CUDA state they cannot use."""
    if device == "cuda" or torch.cuda.is_initialized():
        return "spawn"
    return "fork"


def _import_before_fork() -> None:
    """Import once, in the parent, what every forked process would import for itself: an
    optimizer's first construction imports torch._dynamo (about 1 s of CPU here, in torch 2.11
    and 2.14; the import starts no thread), and forked children inherit it."""
    importlib.import_module("torch._dynamo")


class RankPool:
    """``world_size`` worker processes in one process group, reused across calls."""

    def __init__(self, world_size: int, backend: str = "gloo", device: str = "cpu",
                 start_method: str | None = None, pg_timeout: float = PG_TIMEOUT):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', not {device!r}")
        if backend == "nccl" and device != "cuda":
            raise ValueError("the nccl backend needs device='cuda'")
        reason = group_skip_reason(world_size, backend, device)
        if reason:
            raise RuntimeError(f"cannot start {backend}/{device} ranks: {reason}")
        self.world_size, self.backend, self.device = world_size, backend, device
        self.pg_timeout = pg_timeout
        self.start_method = start_method or _default_start_method(device)
        self._procs: list[mp.Process] = []
        self._conns: list[Connection] = []
        self._tmpdir: str | None = None

    # -- lifecycle

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        self.close()
        context = mp.get_context(self.start_method)
        if self.start_method == "fork":
            _import_before_fork()
        self._tmpdir = tempfile.mkdtemp(prefix="course-ranks-")
        store_path = os.path.join(self._tmpdir, "store")
        for rank in range(self.world_size):
            parent_end, child_end = context.Pipe()
            proc = context.Process(
                target=_worker_main,
                args=(rank, self.world_size, self.backend, self.device, store_path,
                      self.pg_timeout, child_end),
                name=f"course-rank{rank}",
                daemon=True,
            )
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)
        replies = self._collect(START_TIMEOUT, what="start and join the process group")
        self._raise_errors(replies, "starting the pool")

    def close(self) -> None:
        """Stop every worker (politely, then by force) and remove the rendezvous files."""
        # An explicit "stop", not end-of-file: forked workers hold copies of the parent's pipe
        # ends, so closing ours would never reach them as EOF.
        for conn in self._conns:
            try:
                conn.send_bytes(b"")
                conn.close()
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        self._procs, self._conns = [], []
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    # -- calls

    def run(self, fn, *args, timeout: float = CALL_TIMEOUT, **kwargs) -> list:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; return the results in rank order."""
        path = getattr(sys.modules.get(fn.__module__), "__file__", None)
        if path is None or "<locals>" in fn.__qualname__:
            raise TypeError(f"{fn.__qualname__} must be a module-level function in a file")
        if not self.alive:
            self.start()
        message = pickle.dumps((os.path.abspath(path), fn.__module__, fn.__qualname__, args,
                                kwargs))
        try:
            for conn in self._conns:
                conn.send_bytes(message)
            replies = self._collect(timeout, what=f"run {fn.__qualname__}")
        except BaseException:
            self.close()  # interrupted (Ctrl-C, pytest-timeout): leave no worker behind
            raise
        failed = any(reply is None or reply[0] != "ok" for reply in replies)
        if failed:
            self.close()  # other ranks may be stuck in a collective: rebuild on next call
            self._raise_errors(replies, fn.__qualname__)
        return [reply[1] for reply in replies]

    def _collect(self, timeout: float, what: str) -> list:
        """Wait for one reply per rank; stop waiting soon after the first error."""
        replies: list = [None] * self.world_size
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for conn in wait(list(pending), timeout=remaining):
                rank = pending.pop(conn)
                try:
                    replies[rank] = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self._procs[rank].join(timeout=1.0)  # reap it to read its exit code
                    code = self._procs[rank].exitcode
                    replies[rank] = ("error", {
                        "type": "WorkerDied", "task": None, "traceback": "",
                        "message": f"the rank's process died (exit code {code})",
                    })
                if replies[rank][0] == "error":
                    deadline = min(deadline, time.monotonic() + GRACE)
        for rank in pending.values():
            replies[rank] = ("timeout", what, timeout)
        return replies

    def _raise_errors(self, replies: list, what: str) -> None:
        errors = [(rank, r[1]) for rank, r in enumerate(replies) if r[0] == "error"]
        stuck = [rank for rank, r in enumerate(replies) if r[0] == "timeout"]
        if not errors and not stuck:
            return
        if not errors:
            self.close()
            _, doing, limit = replies[stuck[0]]
            raise RankTimeout(
                f"ranks {stuck} did not finish ({doing}) within {limit:.0f} s: a hang, e.g. a "
                f"collective that not every rank calls, or ranks calling collectives in a "
                f"different order"
            )
        # Report the first rank's own error; later ranks often only failed because of it.
        rank, error = errors[0]
        header = f"rank {rank} raised {error['type']} in {what}: {error['message']}"
        others = [f"rank {r}: {e['type']}: {e['message'].splitlines()[0][:200]}"
                  for r, e in errors[1:]]
        if stuck:
            others.append(f"ranks {stuck}: still waiting (stopped)")
        text = header
        if error["traceback"]:
            text += f"\n\n--- traceback on rank {rank} ---\n{error['traceback'].rstrip()}"
        if others:
            text += "\n\n--- other ranks ---\n" + "\n".join(others)
        if error["task"]:
            raise NotAttemptedOnRank(f"{error['message']} (reached on rank {rank})")
        raise RankError(text)



# ------------------------------------------------------------------- one call, its own process


def _child_main(path, module_name, qualname, args, kwargs, conn: Connection) -> None:
    _die_with_parent()
    torch.set_num_threads(1)
    _call_and_reply(conn, path, module_name, qualname, args, kwargs)


def in_a_child(fn, *args, timeout: float = CALL_TIMEOUT, **kwargs):
    """``fn(*args, **kwargs)`` in a fresh process of its own that exits after it, sent, bounded
    and reported like a pool's call. For work that must own this process's default group
    (torch's fake process group, at any world size) or that leaves a process unfit to fork
    ranks from: FSDP2's backward starts autograd's device threads, which forked children
    cannot use, so a pool started after it would fail on its first backward."""
    path = getattr(sys.modules.get(fn.__module__), "__file__", None)
    if path is None or "<locals>" in fn.__qualname__:
        raise TypeError(f"{fn.__qualname__} must be a module-level function in a file")
    context = mp.get_context(_default_start_method("cpu"))
    if context.get_start_method() == "fork":
        _import_before_fork()
    parent_end, child_end = context.Pipe(duplex=False)
    proc = context.Process(target=_child_main, daemon=True, name="course-child",
                           args=(os.path.abspath(path), fn.__module__, fn.__qualname__, args,
                                 kwargs, child_end))
    proc.start()
    child_end.close()
    try:
        if not parent_end.poll(timeout):
            raise RankTimeout(f"{fn.__qualname__} did not finish within {timeout:.0f} s in its "
                              f"own process: a hang (stopped)")
        try:
            reply = pickle.loads(parent_end.recv_bytes())
        except (EOFError, OSError):
            proc.join(timeout=1.0)
            reply = ("error", {"type": "WorkerDied", "task": None, "traceback": "",
                               "message": f"its process died (exit code {proc.exitcode})"})
    finally:
        proc.join(timeout=5.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5.0)
        parent_end.close()
    if reply[0] == "ok":
        return reply[1]
    error = reply[1]
    if error["task"]:
        raise NotImplementedError(error["message"])
    text = f"{fn.__qualname__} raised {error['type']} in its own process: {error['message']}"
    if error["traceback"]:
        text += f"\n\n--- traceback ---\n{error['traceback'].rstrip()}"
    raise RankError(text)

_pools: dict[tuple, RankPool] = {}


def get_pool(world_size: int = 2, backend: str = "gloo", device: str = "cpu",
             pg_timeout: float = PG_TIMEOUT) -> RankPool:
    """The shared pool for (world size, backend, device, pg timeout), started on first use."""
    key = (world_size, backend, device, pg_timeout)
    if key not in _pools:
        _pools[key] = RankPool(world_size, backend, device, pg_timeout=pg_timeout)
    return _pools[key]


def run_on_ranks(fn, *args, world_size: int = 2, backend: str = "gloo", device: str = "cpu",
                 timeout: float = CALL_TIMEOUT, pg_timeout: float = PG_TIMEOUT,
                 **kwargs) -> list:
    """Run ``fn(ctx, *args, **kwargs)`` on ``world_size`` pooled ranks; results in rank order.

    ``pg_timeout`` (seconds) bounds each collective on the ranks: a short one turns a
    demonstrated hang into torch's own timeout error within seconds."""
    pool = get_pool(world_size, backend, device, pg_timeout)
    return pool.run(fn, *args, timeout=timeout, **kwargs)


@atexit.register
def close_all_pools() -> None:
    for pool in _pools.values():
        pool.close()
    _pools.clear()


def _group_needs(world_size: int, backend: str, device: str) -> tuple[int, str]:
    if device == "cpu":
        return 0, ""
    if backend == "nccl":
        ranks = "1 rank" if world_size == 1 else f"{world_size} ranks"
        return world_size, f"nccl with {ranks}, one GPU each"
    return 1, f"gloo with {world_size} ranks sharing cuda:0"


def group_skip_reason(world_size: int, backend: str, device: str) -> str | None:
    """None when this machine can host the group, else a skip reason starting with "needs"."""
    needed, what = _group_needs(world_size, backend, device)
    return gpu_skip_reason(needed, what) if needed else None


def group_params(world_sizes=(2, 3), cuda_world_sizes=(2,), nccl_world_sizes=None) -> list:
    """``pytest.param((world_size, backend, device))`` for the course's hardware matrix.

    gloo/cpu for every size in ``world_sizes``; gloo with ranks sharing cuda:0; nccl with one
    rank per GPU for ``nccl_world_sizes`` (default: 1 up to the GPUs present, at least 1 and 2
    so the skip is visible on machines with fewer). CUDA cases carry the ``gpu`` marker.
    """
    if nccl_world_sizes is None:
        nccl_world_sizes = range(1, max(2, cuda_device_count()) + 1)
    cases = [(n, "gloo", "cpu") for n in world_sizes]
    cases += [(n, "gloo", "cuda") for n in cuda_world_sizes]
    cases += [(n, "nccl", "cuda") for n in nccl_world_sizes]
    params = []
    for n, backend, device in cases:
        needed, what = _group_needs(n, backend, device)
        marks = gpu_marks(needed, what) if needed else []
        params.append(pytest.param((n, backend, device), marks=marks, id=f"{backend}-{device}-{n}"))
    return params
