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
# # Lesson 08 walkthrough: measure a collective, predict DDP's communication
#
# Five steps, all on a CPU: benchmark the all-reduce on two ranks and fit the ring's latency
# and bandwidth; see how DDP groups the running example's gradients into buckets, and what the
# fit predicts for them; let the lesson's script measure the same step; read a profiler trace
# of it, bucket by bucket; then plan an FSDP2 job on 16 ranks in one process.

# %%
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

# Works from the repository root (as a script) and from this folder (as a notebook).
HERE = (Path("lessons/08_measure_and_choose") if Path("lessons/08_measure_and_choose").is_dir()
        else Path("."))
sys.path.insert(0, str(HERE.parent))  # lessons/, where gpt/ lives
sys.path.insert(0, str(HERE))  # this lesson's scripts
from bench_collectives import predict_allreduce_seconds  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun(script: str, *args: str) -> dict:
    """Run one of the lesson's scripts on 2 ranks (a notebook kernel is one process: lesson
    04's pitfall 14), and read back the JSON it writes."""
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "result.json"
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              "--nproc-per-node=2", str(HERE / script), *args, "--result",
                              str(result)], capture_output=True, text=True, timeout=240, env=ENV)
        print(run.stdout)
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(result.read_text())


# %% [markdown]
# ## 1. What one all-reduce costs
#
# All-reduces of 1 KiB to 16 MiB on two gloo ranks. Small ones cost a fixed latency; large
# ones cost bytes over bandwidth. The line fitted to their relative errors (task8_1) gives
# alpha and beta.

# %%
bench = torchrun("bench_collectives.py", "--ops", "all_reduce", "--max-bytes", str(2**24))
alpha, beta = bench["fit"]["alpha_s"], bench["fit"]["beta_s_per_byte"]
print(f"alpha {alpha * 1e6:.0f} us per step, 1/beta {1 / beta / 1e9:.2f} GB/s")

# %% [markdown]
# ## 2. DDP's buckets, and what the fit predicts for them
#
# DDP walks the parameters last first and closes a bucket once it holds at least its limit:
# 1 MiB for the first bucket, 25 MiB after that. torch's own function does the assignment:

# %%
config = GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=256)
model = GPT(config)
params = [p for p in model.parameters() if p.requires_grad][::-1]
buckets, _ = torch.distributed._compute_bucket_assignment_by_size(
    params, [torch.distributed._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20])
sizes = [sum(params[i].numel() * 4 for i in bucket) for bucket in buckets]
print("buckets (MiB):", [round(s / 2**20, 2) for s in sizes])
predicted = sum(predict_allreduce_seconds(s, 2, alpha, beta) for s in sizes)
print(f"predicted all-reduce time per step on 2 ranks: {predicted * 1e3:.1f} ms")

# %% [markdown]
# ## 3. The same step, measured
#
# The lesson's script trains this model with DDP and times steps with and without gradient
# synchronisation (`no_sync`). Their difference is the communication the step waits for.
# Here only the default buckets and 4 steps of each kind, to keep it short:

# %%
costs = torchrun("ddp_costs.py", "--settings", "0", "--steps", "4")
default = costs["settings"]["default buckets (25 MiB)"]
print(f"predicted {default['predicted_s'] * 1e3:.1f} ms, "
      f"exposed {default['exposed_s'] * 1e3:.1f} ms")

# %% [markdown]
# The script's prediction also counts the two copies DDP makes of every gradient (into its
# bucket and back). On a busy 2-core machine the two numbers can differ by tens of percent from
# one run to the next; the README shows why, and which settings move them.


# %% [markdown]
# ## 4. Where the step went: a profiler trace
#
# `read_trace.py` profiles three steps of DDP with small buckets and three with one bucket, and
# reads each trace with the same reading as task8_5: the communication, the part of it no
# backward hides, and each bucket's all-reduce (start + duration from the step's start, and its
# overlap with the backward), in milliseconds.

# %%
traced = torchrun("read_trace.py", "--width", "64", "--blocks", "2")
for name, steps in traced["readings"].items():
    for reading in steps:
        buckets = [f"{start / 1e3:.1f}+{length / 1e3:.1f} ({overlap / 1e3:.1f})"
                   for start, length, overlap in reading["buckets"]]
        print(f"{name:>14}: communication {reading['comm_us'] / 1e3:5.1f} ms, exposed "
              f"{reading['exposed_comm_us'] / 1e3:5.1f} ms; {', '.join(buckets)}")

# %% [markdown]
# On these two busy cores the exposed time moves from step to step: read several steps, and
# compare the settings within one run.
#
# ## 5. A dry run: 16 ranks in this one process
#
# `dry_run.py` plays each rank of an FSDP2 job in torch's fake process group: the shapes of
# every rank's shards, then one step of rank 0 with each collective it issues, against the
# formula of task8_6. Plain `python`, not torchrun: the script is every rank itself. (It runs
# in its own process: a notebook kernel that ran FSDP2's backward could no longer fork ranks.)

# %%
planned = subprocess.run([sys.executable, str(HERE / "dry_run.py"), "--world", "16", "--size",
                          "tiny"], capture_output=True, text=True, timeout=240, env=ENV)
print(planned.stdout)
assert planned.returncode == 0, planned.stderr[-3000:]

# %% [markdown]
# At 16 ranks the 65-row embedding travels as 80 rows. The exercises build the fit, the
# buckets, a bf16 compression hook, the decision between the methods, the reading of a trace
# and this step's collectives by hand.
