"""The multi-GPU doctor: run it first when multi-GPU training freezes or crashes.

    python lessons/04_pitfalls/doctor.py                                    # this process only
    torchrun --standalone --nproc-per-node=2 lessons/04_pitfalls/doctor.py  # N ranks
    torchrun --standalone --nproc-per-node=gpu lessons/04_pitfalls/doctor.py  # one rank per GPU

It reports the versions (torch, CUDA, NCCL, the packages the course needs), the devices this
process sees and CUDA_VISIBLE_DEVICES, each NCCL, gloo and torch.distributed setting that is set
(what it does, its default, and a warning where its value costs), and each rank's device;
checks that a barrier and an all-reduce complete within ``--timeout`` seconds and give the
right value; on CUDA, prints the peer-to-peer access matrix and copies between every pair of
GPUs; measures all-reduce bus bandwidth; and ends with a verdict and next steps. Nothing can
hang: every step runs under a timeout, and the step that fails is named. Rank 0 prints the
report, with the verdict and next steps; any other rank that hits a problem prints one line of
its own, so the report has one line per rank, not one block.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import faulthandler
import importlib.metadata
import json
import os
import platform
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

GRACE = 2.0  # seconds the doctor adds to a step's timeout: torch's own error comes first

NEXT_STEPS = {
    "join": [
        "Check that every rank was started and that all use the same MASTER_ADDR and "
        "MASTER_PORT (torchrun --standalone does this for one machine).",
        "Across machines: a firewall, or the wrong network interface: set NCCL_SOCKET_IFNAME "
        "and GLOO_SOCKET_IFNAME to the interface the machines share (see `ip addr`).",
    ],
    "hang": [
        "Rerun with NCCL_DEBUG=INFO (NCCL_DEBUG_SUBSYS=INIT,P2P,NET for less) to see how NCCL "
        "connects the GPUs and where it stops.",
        "If NCCL is involved, rerun with NCCL_P2P_DISABLE=1 (it turns off NCCL's direct "
        "GPU-to-GPU transport): some boards (consumer GPUs, virtual machines, PCIe ACS or the "
        "IOMMU enabled) report peer-to-peer access that then hangs. Only NCCL reads that "
        "variable; plain CUDA copies (the doctor's peer-to-peer step, nn.DataParallel's "
        "scatter and gather, x.to('cuda:1')) still take the broken path. The fix is in the "
        "machine: disable ACS, set the IOMMU to pass-through or off (BIOS, kernel settings).",
        "If the doctor passes but your training hangs, the cause is in the code: a collective "
        "that not every rank reaches (lesson 04, labs 05 and 06). "
        "TORCH_DISTRIBUTED_DEBUG=DETAIL checks that all ranks call the same collectives in the "
        "same order, but on gloo a DDP model crashes (a segfault) as it is built under it "
        "(torch 2.11 to 2.14): there, read the stacks (next step). On NCCL, read the flight "
        "recorder: on a timeout every rank writes "
        "its last collectives to a file (by default in torch 2.14; TORCH_NCCL_TRACE_BUFFER_SIZE="
        "2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 in older releases), and torchfrtrace compares them.",
        "A rank that missed its deadline, or that the launcher stopped, printed the stack of "
        "each of its threads: the line it waited on. In your own script, "
        "faulthandler.register(signal.SIGUSR2, all_threads=True) at the top lets "
        "`kill -USR2 <pid>` print them at any time (lesson 09), as `py-spy dump --pid <pid>` "
        "does from outside, if py-spy is installed.",
    ],
    "crash": [
        "Another rank died: read its own error above, and torchrun's 'Root Cause' report.",
        "No Python error? Look in `dmesg` for the out-of-memory killer or GPU Xid errors.",
    ],
    "stopped": [
        "Look for the rank that failed first: its own [FAIL] line, or torchrun's 'Root Cause'.",
    ],
    "wrong value": [
        "A collective completed with a wrong result: suspect the hardware path. On NCCL, rerun "
        "with NCCL_P2P_DISABLE=1, then NCCL_SHM_DISABLE=1; `nvidia-smi topo -m` shows the links.",
    ],
    "devices": [
        "Each rank must use its own GPU: torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) "
        "before anything touches CUDA (lesson 04, lab 04). Check CUDA_VISIBLE_DEVICES.",
    ],
    "setup": [
        "Install the course's requirements into the environment you run it from: "
        "pip install -r requirements.txt (inside the course's venv, if you made one).",
    ],
    "error": [
        "Read the error above. NCCL_DEBUG=INFO and TORCH_DISTRIBUTED_DEBUG=DETAIL add detail.",
    ],
}


# ------------------------------------------------------------------ the settings it explains
# The environment variables that decide how a job hangs, fails or how fast it runs. Defaults are
# torch 2.14's (NCCL's for the NCCL_ ones), read from its source: ProcessGroupNCCL.hpp and .cpp,
# FlightRecorder.hpp and .cpp, debug.cpp; NCCL's src/debug.cc. Lesson 04's README tabulates the
# same names and defaults (a test keeps them equal) and says why each one costs what it does.


@dataclasses.dataclass(frozen=True)
class Knob:
    default: str  # what the reader does when the variable is unset
    does: str  # in a few words, for the report
    warnings: dict = dataclasses.field(default_factory=dict)  # value -> what that value costs


KNOBS = {
    "NCCL_DEBUG": Knob(
        "unset (NCCL prints nothing)", "NCCL's log: WARN its errors, INFO also how it connects"),
    "TORCH_DISTRIBUTED_DEBUG": Knob(
        "OFF", "INFO: more logs; DETAIL: every collective is checked across ranks first",
        {"DETAIL": "an extra gloo barrier and comparison before every collective: debugging "
                   "only, never in a timed run; on gloo, a DDP model crashes (a segfault) as "
                   "it is built (torch 2.11 to 2.14)"}),
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": Knob(
        "3; torchrun sets 1", "what the watchdog does to a failed or timed-out collective "
                              "(3, 1: end the process; 2: only abort NCCL's communicators; 0: "
                              "nothing)",
        {"0": "a timed-out collective never ends the process: a hang stays a hang",
         "2": "the process lives on after a timeout, its NCCL communicators aborted"}),
    "TORCH_NCCL_BLOCKING_WAIT": Knob(
        "0", "1: wait() blocks this thread and raises on a timeout; no watchdog thread",
        {"1": "no watchdog: no flight-recorder dump, no heartbeat monitor, and the CPU "
              "thread blocks at every wait"}),
    "TORCH_NCCL_ENABLE_MONITORING": Knob(
        "1", "a thread that ends the process when the watchdog itself is stuck",
        {"0": "a watchdog stuck inside CUDA or NCCL hangs the job until its time limit"}),
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": Knob(
        "480", "about how long the watchdog may be stuck before the monitor ends the process"),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": Knob(
        "1", "on a timeout, every rank writes its flight recorder to a file",
        {"0": "a timeout leaves no record of each rank's last collectives"}),
    "TORCH_FR_BUFFER_SIZE": Knob(
        "2000", "how many collectives the flight recorder keeps per process (0: off)",
        {"0": "the flight recorder is off: a hang leaves no record"}),
    "TORCH_NCCL_TRACE_BUFFER_SIZE": Knob(
        "2000", "the older name of TORCH_FR_BUFFER_SIZE, still read",
        {"0": "the flight recorder is off: a hang leaves no record"}),
    "TORCH_FR_DUMP_TEMP_FILE": Knob(
        "~/.cache/torch/comm_lib_trace_rank_", "where the dumps go: this prefix plus the rank"),
    "TORCH_NCCL_DESYNC_DEBUG": Knob(
        "0", "on a timeout, report which ranks lag or called another collective",
        {"1": "a store write per collective: debugging only"}),
    "NCCL_P2P_DISABLE": Knob(
        "0", "1: NCCL does not copy directly between a machine's GPUs (NVLink, PCIe P2P)",
        {"1": "slower collectives inside the machine: a workaround for a broken board, not "
              "a setting to keep"}),
    "NCCL_SOCKET_IFNAME": Knob("unset (NCCL picks)", "NCCL's network interface"),
    "GLOO_SOCKET_IFNAME": Knob("unset (gloo picks)", "gloo's network interface"),
}
SETTING_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_FR_", "TORCH_DISTRIBUTED", "GLOO_")


def explain_settings(environ) -> list[str]:
    """One line for every NCCL, gloo and torch.distributed setting in ``environ``: its value,
    the default and what it does, plus a warning where the value costs something."""
    lines = []
    for name, value in sorted(environ.items()):
        if not name.startswith(SETTING_PREFIXES):
            continue
        knob = KNOBS.get(name)
        if knob is None:
            lines.append(f"  {name}={value}: not in the doctor's table (see NCCL's or torch's "
                         f"documentation)")
            continue
        lines.append(f"  {name}={value} (default {knob.default}): {knob.does}")
        warning = knob.warnings.get(value.strip().upper())
        if warning:
            lines.append(f"    warning: {warning}")
    return lines


def diagnose(error: BaseException) -> tuple[str, str, str]:
    """(kind of problem, what it means, the error itself) for an exception a step raised."""
    text = " ".join(str(error).split())[:400]
    lower = text.lower()
    missing = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", text)
    if getattr(error, "kind", None):
        return error.kind, text, ""
    if missing:
        return "hang", (f"rank(s) {missing.group(1)} did not reach the barrier in time: stuck "
                        f"in something earlier, or dead"), text
    if "clients joined" in lower or "rendezvous" in lower:
        return "join", "not every rank joined in time", text
    if any(word in lower for word in ("connection closed", "connection reset", "broken pipe",
                                      "remote worker")):
        return "crash", "a peer closed its connection: another rank died", text
    silent = re.search(r"from rank (\d+)", text)
    if "timed out" in lower or "timeout" in lower:
        who = f"rank {silent.group(1)}" if silent else "a peer"
        return "hang", f"{who} did not answer in time", text
    return "error", text, ""


class Doctor:
    def __init__(self, args):
        self.args = args
        self.rank = int(os.environ.get("RANK", 0))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        self.current = "start"
        self.device = None  # this rank's device, once the group is joined
        self.failing = threading.Lock()  # held by the first (and only) failure report
        self.result = {"ok": False, "steps": {}, "failed_step": None, "kind": None}
        signal.signal(signal.SIGTERM, self.on_sigterm)
        # kill -USR2 <pid>: the stacks (not USR1, which lesson 09's SLURM jobs use as the warning)
        faulthandler.register(signal.SIGUSR2, all_threads=True)

    # -- reporting

    def say(self, text: str = "") -> None:
        if self.rank == 0:
            print(text, flush=True)

    def write_result(self) -> None:
        if self.rank == 0 and self.args.result:
            self.args.result.write_text(json.dumps(self.result, default=str))

    def fail(self, step: str, kind: str, problem: str, detail: str = "") -> None:
        """Report the failing step, the verdict and next steps; exit at once (a broken group
        can hang its own clean-up, so nothing else runs)."""
        if not self.failing.acquire(blocking=False):
            return  # another thread is already reporting
        tag = f"[rank {self.rank}]"
        verdict = f"{kind.upper()} in step {step!r} (seen by rank {self.rank}): {problem}"
        if self.rank == 0:
            lines = [f"{tag} [FAIL] {step}: {problem}"]
            lines += [f"{tag}        {detail}"] if detail else []
            lines += [f"{tag} verdict: {verdict}", f"{tag} next steps:"]
            lines += [f"{tag}   - {hint}" for hint in NEXT_STEPS[kind]]
        else:  # one line: rank 0 gives the next steps (its error is the place to start)
            lines = [f"{tag} [FAIL] {step}: {kind.upper()}: {problem}"]
        print("\n".join(lines), flush=True)
        self.result.update(failed_step=step, kind=kind, verdict=verdict)
        self.write_result()
        sys.stdout.flush()
        os._exit(1)

    def on_sigterm(self, signum, frame) -> None:
        """torchrun stops the other ranks when one fails: say where this one was."""
        faulthandler.dump_traceback(all_threads=True)  # and show it: the line it waited on
        self.fail(self.current, "stopped", "the launcher stopped this rank because another one "
                  "failed first")

    def step(self, name: str, action, *args):
        """Run one step in a helper thread, with a deadline; a failure or an overrun ends the
        run, named. The main thread only waits in short slices, so it stays free to handle
        SIGTERM even while the step is stuck inside torch (in C++, where Python cannot
        interrupt it)."""
        self.current = name
        outcome = {}

        def run():
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # the current GPU is per thread
            try:
                outcome["value"] = action(*args)
            except Exception as error:  # noqa: BLE001 - every failure is reported, named
                outcome["error"] = error

        limit = self.args.timeout + GRACE
        began = time.perf_counter()
        helper = threading.Thread(target=run, name=f"doctor: {name}", daemon=True)
        helper.start()
        while helper.is_alive():
            helper.join(timeout=0.1)
            if helper.is_alive() and time.perf_counter() - began > limit:
                faulthandler.dump_traceback(all_threads=True)  # where this rank is stuck
                self.fail(name, "hang", f"no answer within {limit:.0f} s on this rank")
        if "error" in outcome:
            self.fail(name, *diagnose(outcome["error"]))
        seconds = time.perf_counter() - began
        self.result["steps"][name] = seconds
        self.say(f"[ ok ] {name:<32} {seconds:8.3f} s")
        return outcome["value"]

    def simulate(self, what: str) -> None:
        """The hidden test flags: make this rank stall or die in the current step."""
        if self.args.simulate_stall == self.rank and what == "stall":
            print(f"[rank {self.rank}] simulating a stall in {self.current!r}", flush=True)
            time.sleep(10**6)
        if self.args.simulate_crash == self.rank and what == "crash":
            print(f"[rank {self.rank}] simulating a crash in {self.current!r}", flush=True)
            os._exit(13)  # no clean-up, no Python error: as a segfault or the OOM killer


class WrongValue(RuntimeError):
    kind = "wrong value"


class DuplicateDevice(RuntimeError):
    kind = "devices"


# ----------------------------------------------------------------------------- the steps


# What the course installs (requirements.txt) and why; a missing one is named with the fix.
NEEDED_PACKAGES = {
    "torch": "everything",
    "numpy": "torch needs it for .numpy() and all_gather_object, but does not install it",
    "pytest": "grading the exercises",
    "pytest-timeout": "grading: no test may hang",
}
OPTIONAL_PACKAGES = {
    "mkdocs-material": "reading the course with mkdocs serve",
    "jupytext": "opening the walkthroughs as notebooks",
}


def packages() -> tuple[dict[str, str], list[str]]:
    """{package: version or "missing"}, and the lines that explain what is missing."""
    found, problems = {}, []
    for name, why in {**NEEDED_PACKAGES, **OPTIONAL_PACKAGES}.items():
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "missing"
            if name in NEEDED_PACKAGES:
                problems.append(f"{name} is missing ({why})")
    return found, problems


def environment(doctor: Doctor) -> dict:
    versions, problems = packages()
    doctor.say("packages: " + ", ".join(f"{name} {version}" for name, version in versions.items()))
    if problems:
        doctor.fail("versions and devices", "setup", "; ".join(problems),
                    "install what the course needs: pip install -r requirements.txt")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if gpus else "n/a (no GPU)"
    except Exception:  # noqa: BLE001 - a CPU build has no NCCL
        nccl = "n/a"
    info = {
        "torch": torch.__version__, "python": platform.python_version(),
        "cuda": torch.version.cuda or "none (CPU build)", "nccl": nccl,
        "gloo": dist.is_gloo_available(), "nccl_available": dist.is_nccl_available(),
        "host": socket.gethostname(), "gpus": gpus,
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "(not set)"),
        "gpu_names": [torch.cuda.get_device_name(i) for i in range(gpus)],
        "settings": {k: v for k, v in sorted(os.environ.items())
                     if k.startswith(SETTING_PREFIXES)},
        "packages": versions,
    }
    doctor.say(f"torch {info['torch']} | CUDA {info['cuda']} | NCCL {info['nccl']} | "
               f"python {info['python']} | host {info['host']}")
    names = f" {info['gpu_names']}" if gpus else ""
    doctor.say(f"CUDA_VISIBLE_DEVICES={info['CUDA_VISIBLE_DEVICES']} | GPUs visible: {gpus}{names}")
    launched = "RANK" in os.environ
    doctor.say(f"launcher: {'torchrun, ' if launched else 'none (plain python), '}world size "
               f"{doctor.world_size}, {doctor.local_world_size} on this machine")
    explained = explain_settings(os.environ)
    doctor.say(f"settings (torch {torch.__version__.split('+')[0]}; defaults are torch 2.14's, "
               f"lesson 04's table):" if explained else
               "settings: no NCCL_, TORCH_NCCL_, TORCH_FR_, TORCH_DISTRIBUTED or GLOO_ variable "
               "is set: every default holds")
    for line in explained:
        doctor.say(line)
    return info


def join(doctor: Doctor, backend: str) -> tuple[torch.device, object]:
    """Join the group with a timeout; returns this rank's device and a gloo group for the
    monitored barrier (it names the ranks that do not arrive; it exists for gloo only)."""
    limit = doctor.args.timeout if backend == "gloo" else doctor.args.timeout + 10
    timeout = datetime.timedelta(seconds=limit)  # nccl: the doctor's deadline comes first
    if backend == "nccl":
        torch.cuda.set_device(doctor.local_rank)  # before anything else touches CUDA
        device = torch.device("cuda", doctor.local_rank)
    else:
        device = torch.device("cpu")
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:  # plain python: a group of one on a free port
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    control = None if backend == "gloo" else dist.new_group(
        backend="gloo", timeout=datetime.timedelta(seconds=doctor.args.timeout))
    return device, control


def ranks_and_devices(doctor: Doctor, device: torch.device) -> list[dict]:
    mine = {"rank": doctor.rank, "local_rank": doctor.local_rank, "host": socket.gethostname(),
            "pid": os.getpid(), "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "-",
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "(not set)")}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    doctor.say(f"       {'rank':>4} {'local':>5} {'host':<16} {'pid':>8}  device  gpu")
    for r in everyone:
        doctor.say(f"       {r['rank']:>4} {r['local_rank']:>5} {r['host'][:16]:<16} "
                   f"{r['pid']:>8}  {r['device']:<7} {r['gpu']}")
    used = {}
    for r in everyone:
        if r["device"].startswith("cuda"):
            key = (r["host"], r["device"])
            if key in used:
                raise DuplicateDevice(f"ranks {used[key]} and {r['rank']} both use "
                                      f"{r['device']} on {r['host']}")
            used[key] = r["rank"]
    return everyone


def barrier(doctor: Doctor, control) -> None:
    doctor.simulate("stall")
    timeout = datetime.timedelta(seconds=doctor.args.timeout)
    if dist.get_world_size() == 1:
        dist.barrier()
    else:  # names the ranks that did not arrive; gloo only, hence the control group
        dist.monitored_barrier(group=control, timeout=timeout, wait_all_ranks=True)


def all_reduce(doctor: Doctor, device: torch.device) -> None:
    world_size = dist.get_world_size()
    expected = world_size * (world_size + 1) / 2  # ranks contribute 1, 2, ..., W
    for numel in (1, 2**20):
        if numel > 1:  # after the first all-reduce every rank is surely inside this step
            doctor.simulate("crash")
        tensor = torch.full((numel,), float(doctor.rank + 1), device=device)
        dist.all_reduce(tensor)
        wrong = (tensor != expected).sum().item()  # .item() waits for the GPU
        if wrong:
            example = tensor[tensor != expected][0].item()
            raise WrongValue(f"all-reduce of {numel} values gave {wrong} wrong ones: expected "
                             f"{expected:g} everywhere, got e.g. {example:g}")
    doctor.say(f"       every rank got {expected:g} = 1 + ... + {world_size} in every element")


def peer_to_peer(doctor: Doctor) -> list[list[bool]]:
    gpus = torch.cuda.device_count()
    access = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(gpus)]
              for i in range(gpus)]
    doctor.say("       peer-to-peer access (row reads column directly):")
    doctor.say("              " + " ".join(f"cuda:{j:<2}" for j in range(gpus)))
    for i in range(gpus):
        marks = " ".join(f"{'-' if i == j else 'yes' if access[i][j] else 'NO':<7}"
                         for j in range(gpus))
        doctor.say(f"       cuda:{i:<2}  {marks}")
    for i in range(gpus):  # a copy between every pair: where a broken P2P path hangs
        source = torch.full((2**20,), float(i + 1), device=f"cuda:{i}")
        for j in range(gpus):
            if i != j:
                copied = source.to(f"cuda:{j}")
                torch.cuda.synchronize(j)
                if not bool((copied == i + 1).all()):
                    raise WrongValue(f"copy cuda:{i} -> cuda:{j} arrived corrupted")
    return access


def bandwidth(doctor: Doctor, device: torch.device, megabytes: float) -> dict:
    world_size = dist.get_world_size()
    tensor = torch.ones(int(megabytes * 2**20 / 4), device=device)
    dist.all_reduce(tensor)  # warm-up: connections, buffers
    iterations = 5
    if device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - began) / iterations
    algbw = tensor.numel() * 4 / seconds / 1e9
    busbw = algbw * 2 * (world_size - 1) / world_size  # nccl-tests' convention
    doctor.say(f"       {megabytes:>6g} MB  {seconds * 1e3:9.2f} ms  algbw {algbw:7.2f} GB/s  "
               f"busbw {busbw:7.2f} GB/s")
    return {"megabytes": megabytes, "seconds": seconds, "algbw_GBps": algbw,
            "busbw_GBps": busbw}


# ----------------------------------------------------------------------------- the run


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds each step may take before it counts as a hang")
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    parser.add_argument("--sizes", type=str, default=None,
                        help="all-reduce sizes in MB, e.g. 1,16 (default: 1,4,16 on CPU, "
                             "8,64,256 on GPUs)")
    parser.add_argument("--result", type=Path, help="rank 0 writes the report here as JSON")
    # Hidden, for the course's tests: make one rank stall (in the barrier) or die (in the
    # all-reduce), to check that the doctor then ends with a verdict instead of hanging.
    parser.add_argument("--simulate-stall", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--simulate-crash", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    doctor = Doctor(args)

    doctor.say("== multi-GPU doctor ==")
    info = doctor.step("versions and devices", environment, doctor)
    doctor.result["environment"] = info
    backend = args.backend
    if backend == "auto":  # nccl when every rank on this machine has a GPU of its own
        backend = "nccl" if info["gpus"] >= doctor.local_world_size else "gloo"
    if backend == "nccl" and info["gpus"] < doctor.local_world_size:
        doctor.fail("choose the backend", "devices", f"nccl needs one GPU per rank: "
                    f"{doctor.local_world_size} ranks here, {info['gpus']} GPU(s) visible")
    doctor.result["backend"] = backend
    device, control = doctor.step(f"join the process group ({backend})", join, doctor, backend)
    doctor.device = device
    doctor.result["ranks"] = doctor.step("ranks and devices", ranks_and_devices, doctor, device)
    doctor.step("barrier", barrier, doctor, control)
    doctor.step("all-reduce (value check)", all_reduce, doctor, device)
    if info["gpus"] >= 2 and doctor.local_rank == 0:
        doctor.result["p2p"] = doctor.step("peer-to-peer copies", peer_to_peer, doctor)
    elif doctor.rank == 0:
        doctor.say(f"[skip] peer-to-peer: {info['gpus']} GPU(s) on this machine")
    if dist.get_world_size() > 1:
        sizes = args.sizes or ("8,64,256" if device.type == "cuda" else "1,4,16")
        doctor.say(f"       all-reduce bandwidth over {dist.get_world_size()} ranks ({backend}):")
        doctor.result["bandwidth"] = [
            doctor.step(f"bandwidth {float(mb):g} MB", bandwidth, doctor, device, float(mb))
            for mb in sizes.split(",")]
    else:
        doctor.say("[skip] bandwidth: one rank has nobody to talk to; start N ranks with torchrun")

    doctor.result["ok"] = True
    verdict = (f"OK: {dist.get_world_size()} rank(s) joined, and the barrier and the "
               f"all-reduce ({backend}) completed with the right values.")
    doctor.result["verdict"] = verdict
    doctor.say(f"verdict: {verdict}")
    doctor.say("next steps: if your training still hangs, the cause is likely in its code: a "
               "collective not every rank reaches (lesson 04, labs 05 and 06). Run it with "
               "TORCH_DISTRIBUTED_DEBUG=DETAIL, except DDP on gloo, which crashes under it "
               "(torch 2.11 to 2.14): read each rank's stack instead (lesson 09); on NCCL, read "
               "the flight recorder's dumps (lesson 04's settings, lesson 09).")
    doctor.write_result()
    dist.barrier()  # nobody tears down the group while another rank still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
