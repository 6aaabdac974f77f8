# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lesson 09 walkthrough: stop, resume, and get the same run
#
# On a CPU: where a resumed epoch starts; a run that checkpoints, loses its last checkpoints
# and resumes bitwise; what a crashed save leaves and what a restart trusts; a rank killed under
# `torchrun --max-restarts=1`; the arguments a SLURM job would give; a job told to stop before
# its time limit; an elastic job that loses a node; and what the flight recorder keeps.

# %%
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

# Works from the repository root (as a script) and from this folder (as a notebook).
HERE = (Path("lessons/09_survive_and_scale_out")
        if Path("lessons/09_survive_and_scale_out").is_dir() else Path("."))
sys.path.insert(0, str(HERE.parent))  # lessons/, where gpt/ lives
sys.path.insert(0, str(HERE))  # this lesson's scripts
import slurm_args  # noqa: E402
import train_resilient  # noqa: E402
import training_state  # noqa: E402
from gpt import parameter_digest  # noqa: E402

# %% [markdown]
# ## 1. Where a resumed epoch starts
#
# A `DistributedSampler`'s order depends on its seed, the epoch, the rank and the world size,
# nothing else. So "epoch 2, 3 samples done" is all it takes to go on where a run stopped.

# %%
data = range(12)
whole = list(DistributedSampler(data, num_replicas=2, rank=1, seed=0))
resumed = training_state.ResumableSampler(data, num_replicas=2, rank=1, seed=0)
resumed.set_epoch(0, start=3)
print("rank 1's epoch:          ", whole)
print("resumed after 3 samples: ", list(resumed), f"(len {len(resumed)})")
assert list(resumed) == whole[3:]

# %% [markdown]
# ## 2. Checkpoint, lose the last checkpoints, resume: the same weights
#
# The script's `fit()` in this process, on a group of one (a store on port 0: no fixed port).
# It saves every 2 steps; we delete the checkpoints after step 4, as if the run had died
# there, and run it again: it resumes at step 4, mid-epoch, and ends with the same digest.

# %%
if not dist.is_initialized():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
folder = Path(tempfile.mkdtemp(prefix="walkthrough09-"))
options = dict(epochs=1, batch_size=8, train_windows=64, dropout=0.1, save_every=2,
               checkpoint_dir=folder / "ckpt", log=print)
model, _ = train_resilient.fit(torch.device("cpu"), **options)
uninterrupted = parameter_digest(model)
print(sorted(p.name for p in (folder / "ckpt").iterdir()))

# %%
for late in ("step-00000006", "step-00000008"):
    shutil.rmtree(folder / "ckpt" / late)
model, _ = train_resilient.fit(torch.device("cpu"), **options)
print("uninterrupted:", uninterrupted[:16], " resumed:", parameter_digest(model)[:16])
assert parameter_digest(model) == uninterrupted

# %% [markdown]
# ## 3. What a crash leaves, and what a restart trusts
#
# Plant what crashes leave behind: a save that never got its rename, and a newer directory
# whose file was cut short. `resume_point` takes the newest *complete* one: `torch.save`
# writes a zip archive with its index at the end, so a file cut short is not one.

# %%
ckpt = folder / "ckpt"
shutil.copytree(ckpt / "step-00000004", ckpt / "step-00000010.partial")
shutil.copytree(ckpt / "step-00000004", ckpt / "step-00000012")
cut = ckpt / "step-00000012" / "train.pt"
cut.write_bytes(cut.read_bytes()[:1000])
print(sorted(p.name for p in ckpt.iterdir()))
print("step-00000012/train.pt is a zip archive:", zipfile.is_zipfile(cut))
print("resume from:", training_state.resume_point(ckpt).name)
dist.destroy_process_group()

# %% [markdown]
# ## 4. A rank killed under `torchrun --max-restarts=1`
#
# The last rank kills itself after step 5 (`--crash-at-step`). The agent stops the other
# rank, starts both again, and the script resumes from step 3. `LOGLEVEL=INFO` shows the
# agent's decision; `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` gives the new attempt a fresh store
# (the README says why). A notebook kernel is one process, so `torchrun` runs as a command.

# %%
env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO",
       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
run = subprocess.run(
    [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
     "--max-restarts=1", str(HERE / "train_resilient.py"), "--epochs", "1", "--batch-size", "4",
     "--train-windows", "64", "--dropout", "0.1", "--save-every", "3", "--crash-at-step", "5",
     "--checkpoint-dir", str(folder / "restarted")],
    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180, env=env)
keep = ("RANK=", "killing", "attempts left", "resumed from", "epoch 1/1")
print("\n".join(line.split("] ", 1)[-1] for line in run.stdout.splitlines()
                if any(word in line for word in keep)))
assert run.returncode == 0, run.stdout[-3000:]

# %% [markdown]
# ## 5. The arguments a SLURM job gives `torchrun`
#
# Every node of a job runs the same line; `slurm_args.py` turns its SLURM variables into the
# same arguments on each, with the first host of the node list as the meeting point.

# %%
print(slurm_args.expand_nodelist("node[01-04,07]"))
job = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "5", "SLURM_GPUS_ON_NODE": "8",
       "SLURM_JOB_NODELIST": "node[01-04,07]"}
for node in ("node01", "node07"):
    print(node, " ".join(slurm_args.slurm_to_torchrun({**job, "SLURMD_NODENAME": node})))


# %% [markdown]
# ## 6. SIGTERM before the time limit: stop at a step boundary, save, resume
#
# What SLURM sends a job it preempts, sent here by hand to `torchrun` once step 3 is saved.
# `torchrun` passes it on to its ranks; `train_preemptible.py` catches it, every rank stops at
# the same step boundary, saves it and exits with 143 (128 + SIGTERM). Started again, the job
# resumes from that step.

# %%
def until(condition, seconds: float) -> None:
    """Wait for ``condition`` at most ``seconds``: nothing here waits for ever."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert condition(), f"not after {seconds} s"


preempted = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
             str(HERE / "train_preemptible.py"), "--epochs", "1", "--batch-size", "4",
             "--train-windows", "256", "--save-every", "3", "--checkpoint-dir",
             str(folder / "preempted")]
job = subprocess.Popen(preempted, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=env)
until((folder / "preempted" / "step-00000003").exists, 120)
job.send_signal(signal.SIGTERM)
output = job.communicate(timeout=120)[0]
print([line.split("] ", 1)[-1] for line in output.splitlines() if "SIGTERM: stopped" in line])
again = subprocess.run(preempted, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=180, env=env)
print([line.split("] ", 1)[-1] for line in again.stdout.splitlines() if "resumed from" in line])
assert again.returncode == 0, again.stdout[-3000:]

# %% [markdown]
# ## 7. A node lost, and the job goes on with the other: `--nnodes=1:2`
#
# Two `torchrun` agents as two nodes of one process each. After step 5, node 1's process kills
# its agent and itself (`--lose-node-at-step`), as a failed machine would. Node 0's rank fails
# in its next collective, its agent restarts it, the rendezvous drops the silent node, and the
# one rank resumes from step 4's checkpoint, written by two ranks. Node 0 starts first: it
# hosts the rendezvous's store, which the job cannot lose.

# %%
with socket.socket() as probe:  # a port that is free now, for both agents
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
nodes = []
for node in (0, 1):
    nodes.append(subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
         "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
         "--rdzv-id=walkthrough", f"--local-addr=127.0.0.{node + 1}",
         f"--rdzv-conf=is_host={1 - node},last_call_timeout=5,keep_alive_interval=1,"
         "keep_alive_max_attempt=2", str(HERE / "sharded_checkpoint.py"), "--checkpoint-dir",
         str(folder / "elastic"), "--steps", "12", "--save-every", "2", "--lose-node-at-step", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    time.sleep(1)  # node 0's agent binds the port first
survivor = nodes[0].communicate(timeout=120)[0]
nodes[1].communicate(timeout=120)
print(f"node 1's torchrun ended with {nodes[1].returncode} (-9 is SIGKILL)")
keep = ("attempts left", "group_world_size", "resumed from", "trained steps", "sha256")
print("\n".join(line.split("] ", 1)[-1] for line in survivor.splitlines()
                if any(word in line for word in keep)))
assert nodes[0].returncode == 0, survivor[-3000:]
shutil.rmtree(folder)

# %% [markdown]
# ## 8. What the flight recorder keeps
#
# Every process keeps its newest collectives (2000 by default on torch 2.13 and 2.14;
# `TORCH_FR_BUFFER_SIZE` sets the number). A group of one here, three collectives, and its
# record: group, sequence number in that group, name, input sizes. Task9_4 compares such
# records across ranks and names the first collective they disagree on.

# %%
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
values = torch.ones(4)
dist.all_reduce(values)
dist.broadcast(values, src=0)
dist.all_reduce(values[:2])
for entry in pickle.loads(torch._C._distributed_c10d._dump_fr_trace())["entries"][-3:]:
    print(entry["process_group"], entry["collective_seq_id"], entry["profiling_name"],
          entry["input_sizes"])
dist.destroy_process_group()
