"""Lesson 09 exercises: survive a failure, resume exactly, and start on a cluster.

Grade with ``pytest lessons/09_survive_and_scale_out`` (one task: ``-m task9_1``). Each
function's docstring is its contract: what it takes, what it returns, and what the test checks.

A checkpoint is one directory, ``<checkpoints>/step-<8 digits>/``, holding ``train.pt``:

    {"model", "optimizer", "scheduler", "scaler"}: the four state dicts
    "position":   where in the data the run is, e.g. {"epoch": 2, "start": 48, "step": 11}
    "generators": every rank's random generator states, a list indexed by rank

It is written under ``step-<N>.partial/`` and renamed when whole. ``torch.save`` writes a zip
archive whose index comes last, so a file cut short by a crash does not open as one.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from gpt.run import rng_state, set_rng_state, sync_to_disk
from torch import nn
from torch.utils.data import DistributedSampler

TRAIN_STATE = "train.pt"
STEP_DIR = re.compile(r"step-(\d+)")  # a checkpoint's directory name; anything else is not one


# --8<-- [start:ResumableSampler]
class ResumableSampler(DistributedSampler):
    """A ``DistributedSampler`` that can start an epoch part-way through.

    ``set_epoch(epoch, start=k)`` makes the next iteration yield this rank's indices of that
    epoch from the ``k``-th on (``k`` counts this rank's samples already trained on, the same
    number on every rank); ``__len__`` is what is left. ``set_epoch(epoch)`` starts the epoch at
    its beginning, and so does a sampler on which ``set_epoch`` was never called (epoch 0,
    whole: the parent's). The order is the parent's: a function of the seed, the epoch, the
    rank and the world size alone, which is what makes skipping ahead exact. ``start`` below 0
    or above the rank's share raises ``ValueError``.

    The test checks that a resumed epoch yields exactly the rest of an uninterrupted one.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        if not 0 <= start <= self.num_samples:
            raise ValueError(f"start {start} is outside this rank's epoch of "
                             f"{self.num_samples} samples")
        super().set_epoch(epoch)
        self.start = start

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())  # the epoch's whole order, then the part not yet seen
        return iter(indices[self.start:])

    def __len__(self) -> int:
        return self.num_samples - self.start
# --8<-- [end:ResumableSampler]


# --8<-- [start:save_training_state]
def save_training_state(path: str | os.PathLike, model: nn.Module, optimizer, scheduler, scaler,
                        position: Mapping) -> None:
    """Write the checkpoint directory ``path`` (a ``str`` or a path object; the layout
    above); every rank calls it.

    ``model`` is the bare module (for DDP, ``ddp_model.module``: the wrapper's keys carry a
    ``module.`` prefix that a plain model does not load). ``position`` is saved as given. The
    generators differ from rank to rank (each draws its own dropout masks): gather every
    rank's ``rng_state()`` to rank 0 (``dist.all_gather_object``), which writes the file
    (``rng_state``, ``set_rng_state`` and ``sync_to_disk`` are the running example's, in
    ``lessons/gpt/run.py``).

    Whole or not at all, even across a power loss. Rank 0:

    1. writes ``train.pt`` into ``<path>.partial/`` (removed first if an earlier crash left
       one);
    2. makes it durable before the rename: ``sync_to_disk`` the file, then the
       ``.partial`` directory (a file system may put the rename on the disk before the
       file's data, so without this a power loss can leave a short file under the final
       name);
    3. renames the directory to ``path``. A ``path`` that exists already (this step was saved
       before a restart, perhaps broken) is replaced: renamed aside first, to ``<path>.old``
       (removed before, if a crash between these renames left one), removed after;
    4. ``sync_to_disk`` the parent directory: the rename itself becomes durable.

    No rank returns before then. A crash at any moment leaves the earlier checkpoints as they
    were and no half-written ``path``.

    The test trains, saves, crashes a save half-way (``torch.save`` fails after writing part
    of its file), saves over a broken and a whole copy of the same step, then looks at what
    is on disk; it records each fsync and rename, in order.
    """
    path = Path(path)
    generators = [None] * dist.get_world_size()
    dist.all_gather_object(generators, rng_state())  # every rank's, in rank order
    if dist.get_rank() == 0:
        partial = path.with_name(path.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)  # an earlier crash's leftovers
        partial.mkdir(parents=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                    "position": dict(position), "generators": generators},
                   partial / TRAIN_STATE)
        sync_to_disk(partial / TRAIN_STATE)  # the bytes, then the name, before the rename
        sync_to_disk(partial)
        if path.exists():  # saved before a restart: a rename cannot replace a full directory
            old = path.with_name(path.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(partial, path)
            shutil.rmtree(old)
        else:
            os.replace(partial, path)  # one rename: the checkpoint appears whole, or not at all
        sync_to_disk(path.parent)  # the rename itself, on the disk
    dist.barrier()  # nobody goes on (or reads it) before it is there
# --8<-- [end:save_training_state]


# --8<-- [start:load_training_state]
def load_training_state(path: str | os.PathLike, model: nn.Module, optimizer, scheduler, scaler,
                        map_location: str | torch.device = "cpu") -> dict:
    """Restore what :func:`save_training_state` wrote into these objects; return the position.

    Every rank calls it and loads ``train.pt`` with ``map_location`` (this rank's device: a
    file saved from cuda:0 must not land on rank 1's cuda:0), restores the model, the
    optimizer, the scheduler and the scaler, and its own generators (``set_rng_state``
    with the entry of its rank). A checkpoint written by a different number of ranks raises
    ``ValueError`` naming both numbers (its generators belong to ranks that do not exist now;
    resharding is what ``torch.distributed.checkpoint`` is for).

    The test resumes a run and checks each piece, then the parameters after more steps:
    bitwise equal to a run that never stopped.
    """
    state = torch.load(Path(path) / TRAIN_STATE, map_location=map_location, weights_only=True)
    written_by, world_size = len(state["generators"]), dist.get_world_size()
    if written_by != world_size:
        raise ValueError(f"{path} was written by {written_by} ranks; this run has "
                         f"{world_size}: each rank needs its own generator states")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    set_rng_state(state["generators"][dist.get_rank()])
    return state["position"]
# --8<-- [end:load_training_state]


# --8<-- [start:expand_nodelist]
def expand_nodelist(nodelist: str) -> list[str]:
    """The host names of a SLURM node list, in order: ``"node[01-03,07],gpu5"`` gives
    ``["node01", "node02", "node03", "node07", "gpu5"]``.

    Commas separate hosts, except inside brackets; a bracket holds numbers and ranges
    ``a-b``, and a range keeps the width of its first number (``[08-10]``: 08, 09, 10). A name
    with several brackets expands to every combination (``r[1-2]n[1-2]``: r1n1, r1n2, r2n1,
    r2n2), as ``scontrol show hostnames`` does.

    ``ValueError`` for: an empty list, or an empty host (``a,,b``, a trailing comma); brackets
    that do not pair up (one left unclosed, ``node[1-2``; nested, ``node[[1-2]]``; a ``]``
    before its ``[``), with a message that says ``bracket``; a number in a bracket that is not
    plain digits (``node[a-3]``, ``node[+1]``, ``node[ 1]``: ``int()`` alone would take the
    last two); a range that runs backwards.
    """
    def expand(host: str) -> list[str]:  # the first bracket, then the rest of the name
        match = re.search(r"\[([^\]]*)\]", host)
        if not match:
            if not host or "]" in host:
                raise ValueError(f"bad host {host!r} in node list {nodelist!r}")
            return [host]
        head, tail = host[:match.start()], host[match.end():]
        numbers = []
        for part in match.group(1).split(","):
            low, _, high = part.partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                raise ValueError(f"bad range {part!r} in node list {nodelist!r}")
            if high and int(high) < int(low):
                raise ValueError(f"range {part!r} runs backwards in node list {nodelist!r}")
            numbers += [str(n).zfill(len(low)) for n in range(int(low), int(high or low) + 1)]
        rests = expand(tail) if tail else [""]  # the brackets further right
        return [head + number + rest for number in numbers for rest in rests]

    if not nodelist.strip():
        raise ValueError("the node list is empty")
    hosts, depth, begin = [], 0, 0
    for i, char in enumerate(nodelist + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0 or depth > 1:
            raise ValueError(f"unbalanced brackets in node list {nodelist!r}")
        if char == "," and depth == 0:
            hosts += expand(nodelist[begin:i].strip())
            begin = i + 1
    if depth:
        raise ValueError(f"unclosed bracket in node list {nodelist!r}")
    return hosts
# --8<-- [end:expand_nodelist]


# --8<-- [start:slurm_to_torchrun]
def slurm_to_torchrun(env: Mapping[str, str], nproc_per_node: int | None = None) -> list[str]:
    """The arguments for ``torchrun`` on one node of a SLURM job, from that node's environment.

    The job runs one torchrun per node (``srun --ntasks-per-node=1 torchrun ...``); each
    starts that node's processes. Returns, in this order::

        --nnodes=<SLURM_JOB_NUM_NODES>  --nproc-per-node=<GPUs on this node>
        --rdzv-id=<SLURM_JOB_ID>  --rdzv-backend=c10d  --rdzv-endpoint=<first host>:<port>

    - the first host of ``SLURM_JOB_NODELIST`` (expanded) is the endpoint on every node: all
      of them must meet at the same address;
    - the port is ``MASTER_PORT`` when set, else ``20000 + SLURM_JOB_ID % 10000``: two jobs
      sharing a node then do not collide on one port;
    - the GPUs: ``nproc_per_node`` when given, else ``SLURM_GPUS_ON_NODE``, else the number at
      the end of ``SLURM_GPUS_PER_NODE`` (``"4"`` or ``"h100:4"``);
    - ``SLURM_NNODES`` and ``SLURM_NODELIST`` are older names of the same two variables, read
      when the new name is not set (or empty); when both are set, the new name wins.

    ``ValueError`` (naming the variable) for: a variable missing, a node count that is not
    the node list's length, more than one task on a node (several torchruns on one node
    would each start every process), or no GPU count at all. The tasks per node are in
    ``SLURM_TASKS_PER_NODE``, which SLURM sets in every job, in its compressed form
    (``"1(x4)"``: 1 task on each of 4 nodes; ``"2(x3),1"``: 2 on each of 3, then 1), and in
    ``SLURM_NTASKS_PER_NODE``, which it sets only when the job asked ``--ntasks-per-node``:
    check both, and every count in them must be 1. A value of either not in that form
    (``"1(x4"``, ``"one"``) raises ``ValueError`` naming it too.
    The test runs a table of emulated SLURM environments.
    """
    def need(*names: str) -> str:
        for name in names:
            if env.get(name):
                return env[name]
        raise ValueError(f"{' or '.join(names)} is not set: is this running inside a SLURM "
                         "job (sbatch/srun)?")

    hosts = expand_nodelist(need("SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    nodes = int(need("SLURM_JOB_NUM_NODES", "SLURM_NNODES"))
    if nodes != len(hosts):
        raise ValueError(f"SLURM_JOB_NUM_NODES is {nodes} but the node list has "
                         f"{len(hosts)} hosts: {hosts}")
    for name in ("SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        counts = []
        for part in env.get(name, "").split(","):  # "2(x3),1": 2 on each of 3 nodes, then 1
            match = re.fullmatch(r"\s*(\d+)(\(x\d+\))?\s*", part)
            if part.strip() and not match:
                raise ValueError(f"{name} is {env[name]!r}, not counts like 1(x4) or 2,1")
            counts += [int(match.group(1))] if match else []
        if any(count != 1 for count in counts):
            raise ValueError(f"{name} is {env[name]}: start one torchrun per node (srun "
                             "--ntasks-per-node=1); it starts that node's processes")
    job = int(need("SLURM_JOB_ID"))
    if nproc_per_node is None:
        if env.get("SLURM_GPUS_ON_NODE"):
            nproc_per_node = int(env["SLURM_GPUS_ON_NODE"])
        elif env.get("SLURM_GPUS_PER_NODE"):
            nproc_per_node = int(env["SLURM_GPUS_PER_NODE"].rsplit(":", 1)[-1])
        else:
            raise ValueError("no GPU count: SLURM_GPUS_ON_NODE and SLURM_GPUS_PER_NODE are not "
                             "set (ask for --gpus-per-node) and nproc_per_node was not given")
    port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else 20000 + job % 10000
    return [f"--nnodes={nodes}", f"--nproc-per-node={nproc_per_node}", f"--rdzv-id={job}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={hosts[0]}:{port}"]
# --8<-- [end:slurm_to_torchrun]


# --8<-- [start:resume_point]
def resume_point(checkpoints: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``checkpoints``, or ``None`` (also when the
    folder does not exist yet: a first run starts from scratch).

    Only directories named ``step-<digits>`` count, newest by their step number (not by
    name: ``step-100`` is newer than ``step-99``; not by modification time: a copy or a
    restore changes it). One counts only when complete: a crash can leave a ``.partial``
    directory, a directory without its ``train.pt``, or a ``train.pt`` cut short (it does not
    open as a zip archive: ``zipfile.is_zipfile``), and each of those is skipped. The test
    plants all of them.
    """
    folder = Path(checkpoints)
    if not folder.is_dir():
        return None
    candidates = []
    for entry in folder.iterdir():
        match = STEP_DIR.fullmatch(entry.name)
        if match and entry.is_dir() and zipfile.is_zipfile(entry / TRAIN_STATE):
            candidates.append((int(match.group(1)), entry))
    return max(candidates)[1] if candidates else None
# --8<-- [end:resume_point]


# --8<-- [start:first_mismatch]
def first_mismatch(records: dict[int, list[dict]],
                   groups: dict[str, list[int]] | None = None) -> dict | None:
    """Where the ranks' collectives first disagree, from every rank's flight-recorder entries.

    ``records[rank]`` is that rank's list of entries, oldest first: the ``"entries"`` of its
    dump, ``pickle.loads(torch._C._distributed_c10d._dump_fr_trace())``. The keys used here:
    ``"process_group"`` (a pair, the group's name first: ``"0"`` is the default group),
    ``"collective_seq_id"`` (1, 2, ... on each rank, counted per group),
    ``"profiling_name"`` (``"gloo:all_reduce"``, ``"nccl:broadcast"``, ...) and
    ``"input_sizes"`` (a list of shapes). ``groups`` maps a group's name to its member ranks;
    a group it does not name (every group, when it is None) has every rank of ``records``.

    Within a group, every member must record the same collective (the same
    ``profiling_name`` and ``input_sizes``) under each sequence id; where a rank holds several
    entries under one id, its first counts. A member that has no entry under an id another
    member recorded has missed that collective, unless the id is older than its oldest entry of
    that group: the recorder keeps only the newest entries, so what it dropped is unknown, not
    missed. A member with no entry of the group at all (none in ``records``, even) has missed
    all of them. Sends and receives are not compared: they are numbered
    apart (``"p2p_seq_id"``), and their name's operation is ``send`` or ``recv``
    (``"nccl:send 0->1"``, ``"nccl:recv 1<-0"``).

    Returns None when every group agrees. Otherwise the first disagreement, the one with the
    smallest sequence id (between groups, the group whose name sorts first, as a string), as
    ``{"process_group": name, "seq_id": id, "calls": {rank: call}}``: ``call`` is the member's
    ``(profiling_name, input_sizes)``, sizes as tuples, or None where it missed the collective;
    a member for which the id is unknown is left out. The test sweeps generated records with
    one planted divergence (a rank that misses a collective, a different operation, different
    sizes), dropped old entries, subgroups and sends.
    """
    calls: dict[str, dict[int, dict[int, tuple]]] = {}  # group -> rank -> seq id -> call
    for rank, entries in records.items():
        for entry in entries:
            operation = entry["profiling_name"].split(":", 1)[-1].split(" ")[0]
            if operation in ("send", "recv"):  # point-to-point: numbered apart
                continue
            seq = entry["collective_seq_id"]
            call = (entry["profiling_name"], tuple(tuple(size) for size in entry["input_sizes"]))
            calls.setdefault(entry["process_group"][0], {}).setdefault(rank, {}).setdefault(
                seq, call)
    found = []
    for name, by_rank in calls.items():
        members = (groups or {}).get(name, list(records))
        for seq in sorted({seq for recorded in by_rank.values() for seq in recorded}):
            seen = {}
            for rank in members:
                recorded = by_rank.get(rank, {})
                if recorded and seq < min(recorded):
                    continue  # dropped from this rank's buffer: unknown
                seen[rank] = recorded.get(seq)
            if len(set(seen.values())) > 1:
                found.append((seq, name, seen))
                break
    if not found:
        return None
    seq, name, seen = min(found, key=lambda item: (item[0], item[1]))
    return {"process_group": name, "seq_id": seq, "calls": seen}
# --8<-- [end:first_mismatch]


# --8<-- [start:Preemption]
class Preemption:
    """Stop every rank at the same step boundary when the scheduler signals any of them.

    ``with Preemption() as stop:`` installs a handler for each of ``signals``: by default
    SIGTERM (what a preempted or cancelled job's processes get) and SIGUSR1 (the warning before
    the time limit, as slurm/train.sbatch passes it on). The handler only remembers the first
    signal this process caught: Python runs it between two bytecodes of the main thread,
    perhaps in the middle of a collective's or a save's Python code, so it must not exit,
    communicate or write. Leaving the block puts back the handlers that were there before, also
    when the block raised. Python runs signal handlers in the main thread only: entered in
    another thread, it raises RuntimeError saying so.

    ``stop.requested(group=None, device="cpu")`` is called by every rank of ``group`` (the
    default group when None) at every step boundary. It is a collective, one all-reduce of one
    number on ``device`` (the rank's CUDA device under nccl): a rank that caught nothing waits
    for the others, as at any all-reduce, and every rank gets the same answer, True once any
    rank of the group has caught a signal. So every rank saves the same step, and none is left
    waiting in the next step's collectives for a rank that has stopped. Once True, it stays
    True.

    ``stop.signal`` is the agreed signal: the largest of the first signals that the group's
    ranks had caught when ``requested`` first returned True (a rank's later signals do not count:
    SIGUSR1 then SIGTERM is SIGUSR1), 0 before. ``stop.exit_code`` is 128 plus it, the status a
    shell reports for a process that signal ended (143 for SIGTERM), 0 before.

    The test delivers signals to some ranks at various steps (2 to 4 ranks, and a subgroup),
    checks that every rank stops at the first boundary after the first delivery, and counts
    the collectives.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)):
        self.signals = tuple(signals)
        self.caught = 0  # the first signal this process caught (0: none yet)
        self.signal = 0  # the one the ranks agreed on

    def __enter__(self) -> Preemption:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("enter Preemption in the main thread: Python runs signal "
                               "handlers there only")
        self._previous = {sig: signal.signal(sig, self._catch) for sig in self.signals}
        return self

    def _catch(self, signum, frame) -> None:
        self.caught = self.caught or signum  # nothing more: it may run anywhere in the step

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():  # None: one installed outside Python
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def requested(self, group=None, device="cpu") -> bool:
        flag = torch.tensor([self.caught], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)  # any rank's, on every rank
        if not self.signal:  # the first agreement stands
            self.signal = int(flag.item())
        return self.signal != 0

    @property
    def exit_code(self) -> int:
        return 128 + self.signal if self.signal else 0
# --8<-- [end:Preemption]
