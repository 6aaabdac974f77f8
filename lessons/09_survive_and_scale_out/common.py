"""What the test files of lesson 09 share: the lesson's scripts, the model of its training runs,
the environment of a torchrun that restarts, the SLURM tables that grade both task9_2's answer
and slurm_args.py (its own copy of the mapping), and a checkpoint as resume_point finds it."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from harness.launch import QUICK_SAMPLE

LESSON = "09_survive_and_scale_out"
RESILIENT = f"lessons/{LESSON}/train_resilient.py"
# The batch job's settings: 2 epochs of 32 steps on 2 ranks, long enough to be signalled after
# step 3 and stop well before the end; its arguments, and the pooled run that never stops.
PREEMPTED_RUN = dict(epochs=2, batch_size=4, train_windows=256, dropout=0.1)
PREEMPTED_STEPS = (PREEMPTED_RUN["epochs"] * PREEMPTED_RUN["train_windows"]
                   // (2 * PREEMPTED_RUN["batch_size"]))  # on 2 ranks
PREEMPTED = ("--backend", "gloo", *(item for name, value in PREEMPTED_RUN.items()
                                     for item in (f"--{name.replace('_', '-')}", str(value))),
             *QUICK_SAMPLE)
SBATCH = f"lessons/{LESSON}/slurm/train.sbatch"
SHARDED = f"lessons/{LESSON}/sharded_checkpoint.py"
# The elastic job: two nodes of one process (--nnodes=1:2); node 1 is lost after step 5, node 0's
# rank fails in step 6's first collective, and its agent restarts it alone, from step 4's
# checkpoint. The rendezvous's settings make the wait short: a node silent for 1 s x 2 is dead,
# and a round with fewer nodes than the most completes 5 s after it has the fewest.
ELASTIC_RUN = dict(steps=12, save_every=2, lose_node_at_step=5)
ELASTIC = tuple(item for name, value in ELASTIC_RUN.items()
                for item in (f"--{name.replace('_', '-')}", str(value)))
ELASTIC_RESUME = ELASTIC_RUN["lose_node_at_step"] // ELASTIC_RUN["save_every"] * \
    ELASTIC_RUN["save_every"]
ELASTIC_RDZV = {"last_call_timeout": 5, "keep_alive_interval": 1, "keep_alive_max_attempt": 2}
# How long each of conftest.py's background launches may run before it counts as a hang. The four
# start together and share the machine with the other checks: the elastic job takes 34 s alone on
# two cores and 80 s beside the other three; CI, grading several runs at once, saw it pass 90 s.
LAUNCH_TIMEOUT = 180
CONFIG = dict(vocab_size=29, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.1)

# LOGLEVEL=INFO: torchrun shows its agent's decisions (warnings and errors only otherwise).
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: each restart gets a fresh store. torchrun's agent
# otherwise keeps one store for every attempt, and a restarted rank can read the address a dead
# one left there (pytorch/pytorch#135712; tests/test_torch_claims.py shows it).
RESTARTABLE = {"LOGLEVEL": "INFO", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


# ----------------------------------------------------------------------------- the SLURM tables
# task9_2's grader (test_09_2_slurm_arguments.py) and slurm_args.py's check
# (test_09_survive_and_scale_out.py) read the same tables.

JOB = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[01-02]",
       "SLURM_GPUS_ON_NODE": "4", "SLURM_NTASKS_PER_NODE": "1"}
NODELISTS = {
    "node01": ["node01"],
    "node[01-03]": ["node01", "node02", "node03"],
    "node[01-04,07]": ["node01", "node02", "node03", "node04", "node07"],
    "gpu[8-10],login3": ["gpu8", "gpu9", "gpu10", "login3"],
    "a[098-101]-ib": ["a098-ib", "a099-ib", "a100-ib", "a101-ib"],
    "r[1-2]n[1-2]": ["r1n1", "r1n2", "r2n1", "r2n2"],
    "x[3],y[1,5-6],z": ["x3", "y1", "y5", "y6", "z"],
    "node[3-3]": ["node3"],  # a range of one number runs forwards, not backwards
}

# A node list SLURM never writes -> what is wrong with it, in a learner's words.
BAD_NODELISTS = {
    "": "an empty node list",
    "  ": "a blank node list",
    "node[3-1]": "a range that runs backwards",
    "a,,b": "an empty host between two commas",
    "node[1-2],": "a trailing comma (an empty host after it)",
    "node[a-3]": "a bracket of letters, not numbers",
    "node[]": "an empty bracket",
    "node[+1]": "a number with a sign (not plain digits; int() alone takes it)",
    "node[1-+3]": "a range's end with a sign (not plain digits; int() alone takes it)",
    "node[ 1]": "a space in a bracket (not plain digits; int() alone takes it)",
}
# Brackets that do not pair up: refused, and said to be the brackets' fault.
UNPAIRED_BRACKETS = {
    "node[01-02": "an unclosed bracket",
    "a[1-2],b[3": "a bracket unclosed at the end",
    "node]1[": "a ']' before its '['",
    "]a[1]": "a ']' before any '['",
    "node[1-2]]": "a second ']'",
    "node[[1-2]]": "nested brackets",
    "a[1,[2]]": "a bracket inside a bracket",
}


def expected_args(nodes: int, nproc: int, job: int, endpoint: str) -> list[str]:
    return [f"--nnodes={nodes}", f"--nproc-per-node={nproc}", f"--rdzv-id={job}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}"]


ENVIRONMENTS = {
    "two nodes, four GPUs each": (JOB, expected_args(2, 4, 4242, "node01:24242")),
    "five nodes from a compressed list, the old variable names": (
        {"SLURM_JOB_ID": "1234567", "SLURM_NNODES": "5", "SLURM_NODELIST": "gpu-[07-09,12],x3",
         "SLURM_GPUS_ON_NODE": "8"}, expected_args(5, 8, 1234567, "gpu-07:24567")),
    "GPUs from --gpus-per-node=h100:8": (
        {**{k: v for k, v in JOB.items() if k != "SLURM_GPUS_ON_NODE"},
         "SLURM_GPUS_PER_NODE": "h100:8"}, expected_args(2, 8, 4242, "node01:24242")),
    "a port chosen by the job script": (
        {**JOB, "MASTER_PORT": "31337"}, expected_args(2, 4, 4242, "node01:31337")),
    "one task per node, said only in SLURM_TASKS_PER_NODE's compressed form": (
        {**{k: v for k, v in JOB.items() if k != "SLURM_NTASKS_PER_NODE"},
         "SLURM_TASKS_PER_NODE": "1(x2)"}, expected_args(2, 4, 4242, "node01:24242")),
}

# Both names of a variable set, or the new one empty -> the arguments (SLURM sets both, equal).
BOTH_NAMES = {
    "SLURM_JOB_NODELIST and SLURM_NODELIST both set: the new name wins": (
        {**JOB, "SLURM_NODELIST": "old[1-2]"}, expected_args(2, 4, 4242, "node01:24242")),
    "SLURM_JOB_NUM_NODES and SLURM_NNODES both set: the new name wins": (
        {**JOB, "SLURM_NNODES": "3"}, expected_args(2, 4, 4242, "node01:24242")),
    "SLURM_JOB_NODELIST empty: SLURM_NODELIST is read": (
        {**JOB, "SLURM_JOB_NODELIST": "", "SLURM_NODELIST": "gpu[3-4]"},
        expected_args(2, 4, 4242, "gpu3:24242")),
    "SLURM_JOB_NUM_NODES empty: SLURM_NNODES is read": (
        {**JOB, "SLURM_JOB_NUM_NODES": "", "SLURM_NNODES": "2"},
        expected_args(2, 4, 4242, "node01:24242")),
}

WITHOUT_NTASKS = {k: v for k, v in JOB.items() if k != "SLURM_NTASKS_PER_NODE"}
# what is wrong -> (the variable the error must name, the environment)
BAD_ENVIRONMENTS = {
    "no node list": ("SLURM_JOB_NODELIST",
                     {k: v for k, v in JOB.items() if k != "SLURM_JOB_NODELIST"}),
    "a node count that is not the list's": ("SLURM_JOB_NUM_NODES",
                                            {**JOB, "SLURM_JOB_NUM_NODES": "3"}),
    "four tasks per node asked": ("SLURM_NTASKS_PER_NODE", {**JOB, "SLURM_NTASKS_PER_NODE": "4"}),
    "two tasks on each node, compressed": ("SLURM_TASKS_PER_NODE",
                                           {**WITHOUT_NTASKS, "SLURM_TASKS_PER_NODE": "2(x2)"}),
    "one node of the two with two tasks": ("SLURM_TASKS_PER_NODE",
                                           {**WITHOUT_NTASKS, "SLURM_TASKS_PER_NODE": "1,2"}),
    "SLURM_TASKS_PER_NODE not in SLURM's form": (
        "SLURM_TASKS_PER_NODE", {**WITHOUT_NTASKS, "SLURM_TASKS_PER_NODE": "1(x2"}),
    "SLURM_NTASKS_PER_NODE not a count": ("SLURM_NTASKS_PER_NODE",
                                          {**JOB, "SLURM_NTASKS_PER_NODE": "one"}),
    "no GPU count": ("SLURM_GPUS_ON_NODE",
                     {k: v for k, v in JOB.items() if k != "SLURM_GPUS_ON_NODE"}),
    "no job id": ("SLURM_JOB_ID", {k: v for k, v in JOB.items() if k != "SLURM_JOB_ID"}),
}


# ----------------------------------------------------------------------------- checkpoints


def write_checkpoint(folder: Path, step: int | str, cut: bool = False) -> Path:
    path = folder / (f"step-{step}" if isinstance(step, int) else step)
    path.mkdir(parents=True)
    buffer = io.BytesIO()
    torch.save({"position": {"step": step}, "model": {"w": torch.ones(256)}}, buffer)
    data = buffer.getvalue()
    (path / "train.pt").write_bytes(data[: len(data) // 2] if cut else data)
    return path
