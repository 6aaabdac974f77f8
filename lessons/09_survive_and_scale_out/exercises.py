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
        raise NotImplementedError("task9_1: the parent's set_epoch, and remember the start")

    def __iter__(self) -> Iterator[int]:
        raise NotImplementedError("task9_1: the parent's order, from the start-th index on")

    def __len__(self) -> int:
        raise NotImplementedError("task9_1: this rank's samples left in the epoch")
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
    raise NotImplementedError("task9_1: gather generators; rank 0 writes <path>.partial, renames")
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
    raise NotImplementedError("task9_1: train.pt with map_location; this rank's own generators")
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
    raise NotImplementedError("task9_2: split at commas outside brackets; keep the widths")
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
    raise NotImplementedError("task9_2: every node meets at the node list's first host")
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
    raise NotImplementedError("task9_3: the highest step-<N> whose train.pt is a whole zip archive")
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
    raise NotImplementedError("task9_4: compare each group's calls sequence id by sequence id")
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
        raise NotImplementedError("task9_5: a handler per signal that only records it")

    def _catch(self, signum, frame) -> None:
        raise NotImplementedError("task9_5: the handler: remember the first signal, nothing more")

    def __exit__(self, *exc) -> None:
        raise NotImplementedError("task9_5: put the previous handlers back")

    def requested(self, group=None, device="cpu") -> bool:
        raise NotImplementedError("task9_5: every rank learns whether any rank caught a signal")

    @property
    def exit_code(self) -> int:
        raise NotImplementedError("task9_5: 128 + the agreed signal, 0 before")
# --8<-- [end:Preemption]
