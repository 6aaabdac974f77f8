"""Run a lesson script the way a learner does: plain ``python``, ``torchrun``, or the old
``python -m torch.distributed.launch``; with a timeout, and read back its machine-readable result.

    result = run_script("lessons/03_ddp/train_ddp.py", "--epochs", "2",
                        launcher="torchrun", nproc=2)
    result.data["losses"]      # what rank 0 wrote to the file passed as --result
    result.output              # stdout and stderr, each line tagged "[default<rank>]:" by torchrun

The script runs in its own process session, so a timeout kills the launcher and every rank it
started: nothing is left behind. ``torchrun --standalone`` picks a free port itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.exercises import REPO_ROOT, TASK_ID

LAUNCH_TIMEOUT = 120.0  # seconds; a launch takes 2-3 s on a 2-core CPU, ~15 s on a GPU machine

LAUNCHERS = {
    "python": [],
    # --tee 3 tags every line of every rank with its rank: "[default1]: ..."
    "torchrun": ["-m", "torch.distributed.run", "--standalone", "--tee", "3"],
    "launch": ["-m", "torch.distributed.launch", "--standalone", "--tee", "3"],
}


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


def run_script(script: str | os.PathLike, *args: str, launcher: str = "python", nproc: int = 1,
               result: bool = True, timeout: float = LAUNCH_TIMEOUT, env: dict | None = None,
               check: bool = True) -> LaunchResult:
    """Run ``script`` with ``launcher`` ('python', 'torchrun' or 'launch') on ``nproc`` ranks.

    With ``result=True`` the script gets ``--result <file>`` and the JSON it writes there is
    returned in ``.data``. With ``check=True`` a non-zero exit raises :class:`LaunchError`.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {sorted(LAUNCHERS)}, not {launcher!r}")
    script = Path(script)
    if not script.is_absolute():
        script = REPO_ROOT / script
    command = [sys.executable, *LAUNCHERS[launcher]]
    if launcher != "python":
        command.append(f"--nproc-per-node={nproc}")
    command += [str(script), *args]
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    with tempfile.TemporaryDirectory(prefix="course-launch-") as tmp:
        result_path = Path(tmp) / "result.json"
        if result:
            command += ["--result", str(result_path)]
        proc = subprocess.Popen(
            command, cwd=REPO_ROOT, env=child_env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_session(proc)
            output, _ = proc.communicate()
            raise LaunchError(
                f"{_show(command)} ran past its {timeout:.0f} s timeout (a hang?) and was "
                f"stopped. Its output:\n{output}"
            ) from None
        except BaseException:
            _kill_session(proc)  # Ctrl-C or pytest-timeout: take every rank down with us
            raise
        data = json.loads(result_path.read_text()) if result and result_path.exists() else None
    outcome = LaunchResult(command, proc.returncode, output, data)
    if check and proc.returncode != 0:
        stub = _STUB_IN_OUTPUT.search(output)
        if stub:  # an untouched exercise reached inside a launched rank: "not attempted"
            raise NotImplementedError(f"{stub.group(1)} (reached in a launched process)")
        raise LaunchError(f"{_show(command)} exited with {proc.returncode}. Its output:\n{output}")
    if check and result and data is None:
        raise LaunchError(f"{_show(command)} wrote no result file. Its output:\n{output}")
    return outcome


_STUB_IN_OUTPUT = re.compile(r"NotImplementedError: (" + TASK_ID.pattern + r"[^\n]*)")


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _show(command: list[str]) -> str:
    shown = ["python" if part == sys.executable else part for part in command]
    return " ".join(str(Path(p).relative_to(REPO_ROOT)) if p.startswith(str(REPO_ROOT)) else p
                    for p in shown)
