"""Lesson 09: survive and scale out. The lesson's own checks: its scripts, and what its README
claims of torch.

The tasks are graded in test_09_1_exact_resume.py (task9_1), test_09_2_slurm_arguments.py
(task9_2), test_09_3_resume_point.py (task9_3), test_09_4_first_mismatch.py (task9_4) and
test_09_5_preemption.py (task9_5). Checked here, on gloo/CPU ranks:
- slurm_args.py, the batch script's own copy of task9_2's mapping, follows the same tables;
- an FSDP2 checkpoint written by 4 ranks with torch.distributed.checkpoint loads on 2 and goes
  on as one process would;
- sharded_checkpoint.py keeps the newest K checkpoints, and dcp.async_save writes the step it
  was asked at while training changes the parameters; an elastic job (--nnodes=1:2) that loses
  a node goes on, on fewer ranks, exactly as a job started smaller from its last checkpoint;
- TORCH_DISTRIBUTED_DEBUG=DETAIL names mismatched collectives, monitored_barrier the rank that
  did not arrive, and faulthandler's stacks where each rank is (never waiting long);
- the lesson's scripts resume exactly in-process, and under torchrun: a rank SIGKILLed with a
  restart left is restarted and resumed; with none left, torchrun says which rank died and how;
  two torchrun agents form one group of two nodes and train what one node trains;
- slurm/srun's stand-in treats signals as srun does (SIGUSR1 to every process of the step,
  SIGTERM and SIGHUP turned into SIGKILL), so the batch script's stop saves, and a trap that
  sends srun SIGTERM saves nothing; the batch script passes --cpus-per-task on to srun;
- monitored_barrier names the first missing rank; the workers' store is rank 0's when the
  agent's is not shared;
- a train.pt cut short is not a zip archive, and torch.load refuses it (resume_point relies on it).

    pytest lessons/09_survive_and_scale_out/test_09_survive_and_scale_out.py
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import re
import shutil
import signal
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint  # noqa: F401 - imported here once, so forked ranks have it
import torch.distributed.fsdp  # noqa: F401 - the same: seconds per rank otherwise
from gpt import GPT, CharDataset, GPTConfig, parameter_digest

from harness.compare import assert_parameters_close
from harness.exercises import REPO_ROOT, load_lesson_module
from harness.hardware import needs_gpus
from harness.launch import QUICK_SAMPLE, QUICK_SAMPLE_LENGTH, path_with, start_nodes, start_script
from harness.ranks import run_on_ranks
from lesson09.common import (
    BAD_ENVIRONMENTS,
    BAD_NODELISTS,
    BOTH_NAMES,
    CONFIG,
    ELASTIC_RESUME,
    ELASTIC_RUN,
    ENVIRONMENTS,
    JOB,
    LAUNCH_TIMEOUT,
    LESSON,
    NODELISTS,
    PREEMPTED_RUN,
    PREEMPTED_STEPS,
    RESILIENT,
    RESTARTABLE,
    SBATCH,
    UNPAIRED_BRACKETS,
    write_checkpoint,
)


def test_slurm_args_py_follows_the_same_table(outside_launcher, capsys):
    """`slurm_args.py`, the batch script's own copy of task9_2's mapping, gives the answers of
    task9_2's tables (node lists good and bad, environments good and broken), prints the
    arguments, and exits with 2 saying "SLURM_JOB_ID is not set" without one.

    The script carries its own copy because it must run on a cluster's node alone."""
    script = load_lesson_module(LESSON, "slurm_args")
    for nodelist, hosts in NODELISTS.items():
        assert script.expand_nodelist(nodelist) == hosts, nodelist
    for nodelist in {**BAD_NODELISTS, **UNPAIRED_BRACKETS}:
        with pytest.raises(ValueError, match="bracket" if nodelist in UNPAIRED_BRACKETS else None):
            script.expand_nodelist(nodelist)
    for case, (env, want) in {**ENVIRONMENTS, **BOTH_NAMES}.items():
        assert script.slurm_to_torchrun(env) == want, case
    for variable, env in BAD_ENVIRONMENTS.values():
        with pytest.raises(ValueError, match=variable):
            script.slurm_to_torchrun(env)
    pairs = [f"--env={name}={value}" for name, value in JOB.items()]
    assert script.main(pairs) == 0
    assert capsys.readouterr().out.split() == ENVIRONMENTS["two nodes, four GPUs each"][1]
    assert script.main(pairs[1:]) == 2  # no SLURM_JOB_ID
    assert "SLURM_JOB_ID is not set" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the scripts


def script_fit_on_rank(ctx, name: str, folder: str | None, **options) -> dict:
    script = load_lesson_module(LESSON, name)
    quiet = dict(epochs=2, batch_size=8, train_windows=32, dropout=0.1,
                 sample_length=QUICK_SAMPLE_LENGTH, log=lambda *args, **kwargs: None)
    model, result = script.fit(ctx.device, checkpoint_dir=folder and Path(folder),
                               **{**quiet, **options})
    return {"digest": parameter_digest(model), "train_loss": result["train_loss"]}


def test_train_checkpoint_resumes_from_an_epoch_bitwise(tmp_path):
    """`train_checkpoint.py` saves after each of 2 epochs of 2 steps and, with the last checkpoint
    removed, resumes from epoch 1's: bitwise the same weights and the same epoch-2 loss as the run
    that never stopped. `fit` on 2 pooled gloo ranks, dropout 0.1."""
    whole = run_on_ranks(script_fit_on_rank, "train_checkpoint", str(tmp_path), world_size=2)
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert saved == ["step-00000002", "step-00000004"], saved  # 2 steps an epoch, 2 epochs
    shutil.rmtree(tmp_path / "step-00000004")  # as if it had stopped after epoch 1
    resumed = run_on_ranks(script_fit_on_rank, "train_checkpoint", str(tmp_path), world_size=2)
    assert resumed[0]["digest"] == whole[0]["digest"], "resumed after epoch 1: other weights"
    assert resumed[0]["train_loss"] == whole[0]["train_loss"][1:]


def test_train_resilient_resumes_mid_epoch_bitwise(tmp_path):
    """`train_resilient.py --save-every 3` saves at steps 3 and 6 of 2 epochs of 4 and, with step
    6's removed, resumes at step 3, mid-epoch: bitwise the same weights as the run that never
    stopped. `fit` on 2 pooled gloo ranks, dropout 0.1."""
    whole = run_on_ranks(script_fit_on_rank, "train_resilient", str(tmp_path), world_size=2,
                         batch_size=4, save_every=3)
    saved = sorted(p.name for p in tmp_path.iterdir())
    assert saved == ["step-00000003", "step-00000006"], saved  # 8 steps, 4 an epoch
    shutil.rmtree(tmp_path / "step-00000006")  # as if it had stopped after step 5
    resumed = run_on_ranks(script_fit_on_rank, "train_resilient", str(tmp_path), world_size=2,
                           batch_size=4, save_every=3)
    assert resumed[0]["digest"] == whole[0]["digest"], "resumed at step 3, mid-epoch: other"


def state_onto_meta_on_rank(ctx, folder: str) -> dict:
    """The scripts' training_state.save, then its load onto the meta device, as a GPU rank
    loads onto cuda:k: the generators must come back all the same (and the step folder, saved
    twice as after a restart, must be replaced)."""
    state = load_lesson_module(LESSON, "training_state")
    path = Path(folder) / "step-00000001"
    model = GPT(GPTConfig(**CONFIG), seed=0)
    torch.manual_seed(5 + ctx.rank)
    for _ in range(2):
        state.save(path, {"model": model}, {"epoch": 0, "start": 0, "step": 1})
    saved = torch.get_rng_state()
    torch.manual_seed(999)
    position = state.load(path, {"model": GPT(GPTConfig(**CONFIG)).to("meta")}, "meta")
    return {"restored": torch.equal(torch.get_rng_state(), saved), "position": position,
            "left": sorted(p.name for p in Path(folder).iterdir())}


def test_the_scripts_restore_generators_whatever_device_the_tensors_load_onto(tmp_path):
    """The scripts' `training_state.load` onto the meta device, as a GPU rank loads onto cuda:k,
    gives each of 2 gloo ranks its own generator back and the position; a step saved twice, as
    after a restart, is replaced, not doubled."""
    for rank, got in enumerate(run_on_ranks(state_onto_meta_on_rank, str(tmp_path),
                                            world_size=2)):
        assert got["restored"], f"rank {rank}: training_state.load did not restore its generator"
        assert got["position"]["step"] == 1
        assert got["left"] == ["step-00000001"], got["left"]


@pytest.fixture(scope="module")
def uninterrupted() -> str:
    """The weights of the torchrun runs' settings, trained without a stop on 2 pooled ranks."""
    return run_on_ranks(script_fit_on_rank, "train_resilient", None, world_size=2,
                        epochs=1, batch_size=4, train_windows=64, save_every=3)[0]["digest"]


@pytest.mark.slow  # a torchrun launch
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)  # waits on a background launch
def test_torchrun_restarts_a_killed_rank_and_the_run_resumes_exactly(launches, uninterrupted):
    """Under `torchrun --max-restarts=1`, rank 1 of 2 killed with `SIGKILL` after step 5 is
    restarted: the agent stops rank 0 with SIGTERM, starts both again
    (`TORCHELASTIC_RESTART_COUNT=1`), they resume from step 3 and end with the weights of 2 pooled
    ranks that never stopped. gloo."""
    run = launches["runs"]["restart"].result()
    assert "killing itself after step 5" in run.output
    # The agent's decisions, at LOGLEVEL=INFO (torchrun shows warnings and errors otherwise).
    assert "failed (exitcode: -9) local_rank: 1" in run.output, run.output[-3000:]
    assert "Worker group FAILED. 1/1 attempts left; will restart worker group" in run.output
    assert "resumed from" in run.output and "step-00000003" in run.output, run.output[-3000:]
    restarted = [line for line in run.output.splitlines() if "TORCHELASTIC_RESTART_COUNT=1" in line]
    assert len(restarted) == 2, f"both ranks start again, and know their attempt: {restarted}"
    assert "closing signal SIGTERM" in run.output, "the agent stops the rank that still runs"
    assert run.data["params_sha256"] == uninterrupted, (
        "killed at step 5, restarted, resumed from step 3: not the uninterrupted run's weights")


@pytest.mark.slow  # a torchrun launch
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)  # waits on a background launch
def test_without_restarts_left_torchrun_names_the_dead_rank(launches):
    """With no restart left, `torchrun` of one process killed with `SIGKILL` after step 5 fails,
    naming rank 0 and `Signal 9 (SIGKILL)`; `step-00000003` is there to resume from by hand."""
    run = launches["runs"]["no-restart"].result()
    assert run.returncode != 0
    assert "killing itself after step 5" in run.output
    assert "Signal 9 (SIGKILL)" in run.output, run.output[-3000:]
    assert "rank      : 0 (local_rank: 0)" in run.output, run.output[-3000:]
    saved = sorted(p.name for p in launches["folders"]["no-restart"].iterdir())
    assert saved == ["step-00000003"], f"the checkpoint to resume from by hand: {saved}"


@pytest.mark.slow  # the batch job, twice
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)  # waits on a background launch
def test_a_slurm_job_of_two_nodes_gives_each_rank_its_place(launches):
    """`slurm/train.sbatch` under the stand-ins for `sbatch` and `srun` (two emulated nodes, a
    `torchrun` of one process each) forms one group in both attempts of the job: `RANK` 0 and 1,
    `GROUP_RANK` 0 and 1, `LOCAL_RANK` 0 on both, `WORLD_SIZE` 2."""
    run = launches["runs"]["two nodes"].result()
    first, _, again = run.output.partition("sbatch (stand-in): job 4242 starts again")
    for attempt in (first, again):
        found = sorted(re.findall(r"RANK=(\d+) LOCAL_RANK=(\d+) GROUP_RANK=(\d+) WORLD_SIZE=(\d+)",
                                  attempt))
        # Two nodes of one process: global ranks 0 and 1, one on each node, each local rank 0.
        assert found == [("0", "0", "0", "2"), ("1", "0", "1", "2")], attempt[-3000:]
    assert run.data["world_size"] == 2


@pytest.mark.slow  # the batch job, twice
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)  # waits on a background launch
def test_a_job_signalled_before_its_time_limit_saves_requeues_and_resumes_exactly(launches):
    """`slurm/train.sbatch` on two emulated nodes, its batch shell sent SIGUSR1 once step 3 is
    saved: both ranks stop after one same later step, save it, exit with 138; the job requeues
    itself, resumes from that step and ends bitwise with one node of two processes that never
    stopped.

    The signal's path: SIGUSR1 to the batch shell (--signal=B:USR1@90) -> SIGUSR1 to srun, which
    forwards it to every process of the step (each node's torchrun and its ranks) -> torchrun,
    told to handle it, sends it on; rank 0 says once where every rank stopped."""
    run = launches["runs"]["two nodes"].result()
    folder = launches["folders"]["two nodes"]
    stopped, _, again = run.output.partition("sbatch (stand-in): job 4242 starts again")
    assert again, f"the job was not requeued and started again: {run.output[-3000:]}"
    assert "SIGUSR1 to job 4242's batch shell" in stopped, stopped[-2000:]
    assert "forcing job termination" not in stopped, (
        f"srun killed the step: the trap must pass on a signal srun forwards: {stopped[-3000:]}")
    found = re.findall(r"SIGUSR1: stopped after step (\d+), saved; exit code 138", stopped)
    assert len(found) == 1, f"rank 0 says where every rank stopped, once: {found}\n{stopped}"
    step = int(found[0])
    assert 3 < step < PREEMPTED_STEPS, (
        f"stopped after step {step}: not between step 3 and the last ({PREEMPTED_STEPS})")
    assert re.search(r"Received (Signals\.)?(SIGUSR1|10) death signal, shutting down workers",
                     stopped), "each node's torchrun passes SIGUSR1 on to its ranks"
    # torchrun ends with 1 after a death signal, whatever its ranks returned; the node whose
    # torchrun ends second may be given SIGTERM first (--kill-on-bad-exit): 1 or 143.
    assert re.search(r"\(srun exited with (1|143)\): requeueing job 4242", stopped), (
        stopped[-2000:])
    assert "job 4242 requeued" in stopped, stopped[-2000:]
    assert f"resumed from {folder / f'step-{step:08d}'}" in again, (
        f"the requeued job resumes where it stopped: {again[-3000:]}")
    assert "SIGUSR1: stopped" not in again and run.returncode == 0, again[-3000:]
    reference = run_on_ranks(script_fit_on_rank, "train_preemptible", None, world_size=2,
                             **PREEMPTED_RUN)[0]
    assert run.data["params_sha256"] == reference["digest"], (
        f"two nodes of one process, stopped after step {step} and resumed: not the weights of "
        "one node of two processes that never stopped")


@pytest.mark.slow  # the batch job, once
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)  # waits on a background launch
def test_a_trap_that_sends_srun_sigterm_loses_the_step_the_warning_was_for(launches):
    """The batch script whose trap passes the warning on as SIGTERM to `srun` saves nothing at the
    stop: the stand-in, as `srun`, kills the step ("forcing job termination", exit 137), and only
    the periodic checkpoints (`--save-every 3`) are left.

    srun does not forward SIGTERM, it kills the step with SIGKILL (Slurm 24.05,
    src/srun/srun_job.c, _srun_signal_mgr), and so does its stand-in: the job loses every step
    since its last periodic checkpoint."""
    run = launches["runs"]["sigterm to srun"].result()
    folder = launches["folders"]["sigterm to srun"]
    assert "SIGUSR1 to job 4243's batch shell" in run.output, run.output[-3000:]
    assert "forcing job termination" in run.output, (
        f"SIGTERM to srun: the step must be killed, as srun kills it: {run.output[-3000:]}")
    assert "stopped after step" not in run.output, (
        f"a rank stopped and saved after SIGTERM to srun: real srun would have killed it "
        f"first: {run.output[-3000:]}")
    assert "(srun exited with 137)" in run.output, run.output[-3000:]
    saved = sorted(int(path.name.split("-")[1]) for path in folder.glob("step-*"))
    assert saved and all(step % 3 == 0 for step in saved), (
        f"checkpoints {saved}: only the periodic ones (--save-every 3), none at the stop")


SIGNAL_REPORTER = """
report() { echo "$1 $2 got $3" >> "$REPORT"; }
child() {
    trap 'report child $SLURM_NODEID USR1' USR1; trap 'report child $SLURM_NODEID TERM' TERM
    echo "child $SLURM_NODEID $BASHPID" >> "$REPORT"
    while :; do sleep 0.05; done
}
trap 'report task $SLURM_NODEID USR1' USR1; trap 'report task $SLURM_NODEID TERM' TERM
export -f child report
setsid bash -c child &  # in a session of its own, as torchrun starts its workers
echo "task $SLURM_NODEID $$" >> "$REPORT"
while :; do sleep 0.05; done
"""


def srun_stand_in(tmp_path, *options: str):
    """slurm/srun running SIGNAL_REPORTER on 2 emulated nodes, once both nodes' task and its
    child have said their pids: (the process, the report file)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    script, report = tmp_path / "task.sh", tmp_path / "report"
    script.write_text(SIGNAL_REPORTER)
    process = subprocess.Popen(
        ["bash", str(REPO_ROOT / f"lessons/{LESSON}/slurm/srun"), *options, "bash", str(script)],
        env={**os.environ, "REPORT": str(report), "FAKE_SLURM_NODES": "2"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (
            not report.exists() or len(report.read_text().splitlines()) < 4):
        time.sleep(0.05)
    return process, report


def running(pid: int) -> bool:
    """Alive, and not a zombie that nobody has reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def pids_in(report) -> list[int]:
    return [int(line.split()[2]) for line in report.read_text().splitlines()
            if not line.split()[2].startswith("got")]


def test_the_srun_stand_in_forwards_usr1_to_every_process_and_kills_on_term(tmp_path):
    """`slurm/srun` on 2 emulated nodes passes SIGUSR1 to every process of every node's task, a
    child in a session of its own too; SIGTERM or SIGHUP reaches none of them: "forcing job
    termination", exit 137, and no process of the step outlives it.

    That is what srun does (Slurm 24.05: src/srun/srun_job.c, _srun_signal_mgr; slurmstepd
    signals the step's whole container, src/slurmd/slurmstepd/req.c,
    _handle_signal_container)."""
    for stop in (signal.SIGTERM, signal.SIGHUP):
        process, report = srun_stand_in(tmp_path / stop.name)
        try:
            pids = pids_in(report)
            assert len(pids) == 4, report.read_text()
            process.send_signal(signal.SIGUSR1)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and report.read_text().count("got USR1") < 4:
                time.sleep(0.05)
            got = sorted(line for line in report.read_text().splitlines() if "got" in line)
            assert got == ["child 0 got USR1", "child 1 got USR1", "task 0 got USR1",
                           "task 1 got USR1"], got
            process.send_signal(stop)
            output, _ = process.communicate(timeout=20)
        finally:
            if process.poll() is None:
                process.kill()
        assert "forcing job termination" in output, output
        assert "got TERM" not in report.read_text(), (
            f"{stop.name} to srun was passed on: srun turns it into SIGKILL")
        assert process.returncode == 128 + signal.SIGKILL, output
        deadline = time.monotonic() + 5
        while (left := [pid for pid in pids if running(pid)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"processes of the step outlived it: {left}"


@pytest.mark.slow
def test_the_batch_script_starts_one_torchrun_per_node_and_shares_out_the_cpus(tmp_path):
    """The batch script, with stand-ins for `srun` and `torchrun` on 2 emulated nodes, gives
    each node's `torchrun` the job's arguments, `--max-restarts=2` and SIGUSR1 to handle, each
    process `OMP_NUM_THREADS=4` (16 CPUs, 4 GPUs), and its task every CPU of
    `--cpus-per-task` (up to this machine's).

    The srun of Slurm 22.05 and 23.02 (and its stand-in) does not read SLURM_CPUS_PER_TASK, so
    the script must pass --cpus-per-task to srun itself."""
    fake = tmp_path / "torchrun"
    fake.write_text('#!/usr/bin/env bash\necho "node $SLURM_NODEID: '
                    '$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) CPUs, OMP_NUM_THREADS='
                    '$OMP_NUM_THREADS torchrun $*"\n')
    fake.chmod(0o755)
    run = start_script(SBATCH, "--epochs", "1", launcher="bash", result=False, timeout=60,
                       env={"PATH": path_with(tmp_path, REPO_ROOT / SBATCH.rsplit("/", 1)[0]),
                            "OMP_NUM_THREADS": "", "SLURM_CPUS_PER_TASK": "16",
                            "SLURM_GPUS_ON_NODE": "4", "SLURM_JOB_ID": "4242",
                            "FAKE_SLURM_NODES": "2"}).result()
    lines = sorted(line for line in run.output.splitlines() if line.startswith("node "))
    assert len(lines) == 2, run.output
    cpus = min(16, len(os.sched_getaffinity(0)))  # the stand-in binds at most what it has
    for node, line in enumerate(lines):
        assert line.startswith(f"node {node}: {cpus} CPUs, "), (
            f"the task may use fewer CPUs than --cpus-per-task gives it ({cpus} on this "
            f"machine): was srun given --cpus-per-task? {line}")
        assert line.startswith(f"node {node}: {cpus} CPUs, OMP_NUM_THREADS=4 torchrun "
                               f"--nnodes=2 --nproc-per-node=4 --rdzv-id=4242 "
                               f"--rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:24242 "
                               f"--max-restarts=2 "), (
            f"16 CPUs for 4 processes per node: 4 threads each, and the node's torchrun "
            f"arguments: {line}")
        assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 " in line, (
            f"torchrun must pass SIGUSR1 on, not die of it: {line}")
        assert line.endswith("--save-every 50 --epochs 1"), line


def dcp_save_on_rank(ctx, folder: str) -> dict:
    script = load_lesson_module(LESSON, "sharded_checkpoint")
    dataset = CharDataset(32)
    model, optimizer = script.build(GPTConfig.named("tiny", vocab_size=dataset.vocab_size))
    script.train(model, optimizer, dataset, 0, 3, 8)
    script.save(Path(folder) / "step-00000003", model, optimizer, 3)
    return {"whole": script.full_state(model)}


def dcp_resume_on_rank(ctx, folder: str) -> dict:
    script = load_lesson_module(LESSON, "sharded_checkpoint")
    dataset = CharDataset(32)
    model, optimizer = script.build(GPTConfig.named("tiny", vocab_size=dataset.vocab_size))
    path = script.newest_checkpoint(Path(folder))
    step = script.load(path, model, optimizer)
    loaded = script.full_state(model)
    script.train(model, optimizer, dataset, step, 6, 8)
    return {"path": path.name, "step": step, "loaded": loaded, "final": script.full_state(model)}


def test_a_sharded_checkpoint_of_4_ranks_resumes_on_2(tmp_path):
    """An FSDP2 checkpoint saved with DCP by 4 gloo ranks (`.metadata` and a file per rank) loads
    on 2 with every tensor bitwise as saved; after 3 more steps they equal one process's 6 steps
    to fp32 tolerance (the sums are split differently)."""
    saved = run_on_ranks(dcp_save_on_rank, str(tmp_path), world_size=4)[0]["whole"]
    files = sorted(p.name for p in (tmp_path / "step-00000003").iterdir())
    assert files == [".metadata"] + [f"__{rank}_0.distcp" for rank in range(4)], files
    resumed = run_on_ranks(dcp_resume_on_rank, str(tmp_path), world_size=2)[0]
    assert (resumed["path"], resumed["step"]) == ("step-00000003", 3)
    for name, tensor in saved.items():  # resharding moves bytes; it changes none
        assert torch.equal(resumed["loaded"][name], tensor), f"{name} changed in the resharding"
    script = load_lesson_module(LESSON, "sharded_checkpoint")
    dataset = CharDataset(32)
    alone, optimizer = script.build(GPTConfig.named("tiny", vocab_size=dataset.vocab_size),
                                    shard=False)
    script.train(alone, optimizer, dataset, 0, 6, 8, share=False)
    assert_parameters_close(resumed["final"], alone.state_dict(), "after resharding 4 -> 2")


def dcp_keep_on_rank(ctx, folder: str, asynchronous: bool) -> dict:
    """Saves after steps 1, 2 and 3 with the newest 2 kept; once the third is asked for, the
    parameters change in place and two more steps train, while it is written (when
    ``asynchronous``)."""
    script = load_lesson_module(LESSON, "sharded_checkpoint")
    dataset = CharDataset(32)
    model, optimizer = script.build(GPTConfig.named("tiny", vocab_size=dataset.vocab_size))
    saves = script.Checkpoints(Path(folder), keep=2, asynchronous=asynchronous)
    for step in (1, 2, 3):
        script.train(model, optimizer, dataset, step - 1, step, 8)
        asked = script.full_state(model)  # the model the save is asked for
        saves.save(model, optimizer, step)
    with torch.no_grad():  # at once, in place, as an optimizer step would: step 3 is written
        for parameter in model.parameters():
            parameter.add_(1.0)
    script.train(model, optimizer, dataset, 3, 5, 8)
    saves.wait()
    kept = [path.name for path in script.checkpoints(Path(folder))]
    fresh, fresh_optimizer = script.build(GPTConfig.named("tiny", vocab_size=dataset.vocab_size))
    step = script.load(Path(folder) / "step-00000003", fresh, fresh_optimizer)
    return {"kept": kept, "step": step, "asked": asked, "saved": script.full_state(fresh),
            "on": sorted(p.name for p in Path(folder).iterdir())}


@pytest.mark.parametrize("asynchronous", [False, True], ids=["dcp.save", "dcp.async_save"])
def test_the_newest_k_checkpoints_are_kept_and_a_save_holds_the_step_it_was_asked_at(
        tmp_path, asynchronous):
    """`sharded_checkpoint.Checkpoints(keep=2)` after saves of steps 1, 2 and 3 leaves steps 2
    and 3 alone; step 3 holds the model it was asked for, bitwise, though every parameter changed
    in place as the call returned and two more steps trained. On 2 gloo ranks (FSDP2), with
    `dcp.save` and `dcp.async_save`.

    With dcp.save the same check is the control: that save is whole before the call returns."""
    ranks = run_on_ranks(dcp_keep_on_rank, str(tmp_path), asynchronous, world_size=2)
    got = ranks[0]
    assert got["kept"] == got["on"] == ["step-00000002", "step-00000003"], (
        f"--keep 2 after saves of steps 1, 2 and 3: {got['on']} on disk")
    assert got["step"] == 3
    for name, tensor in got["asked"].items():
        assert torch.equal(got["saved"][name], tensor), (
            f"{name}: the checkpoint of step 3 holds other values than step 3's model (a save "
            f"that did not copy the state before training went on?)")


@pytest.mark.slow  # two torchrun agents
@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)  # waits on a background launch
def test_an_elastic_job_that_loses_a_node_goes_on_as_a_smaller_job_from_its_checkpoint(
        launches):
    """An elastic job (`--nnodes=1:2`, two agents of one gloo process) that loses node 1 after
    step 5 (its agent and its process `SIGKILL`ed) goes on alone from step 4's checkpoint of 2
    ranks, and ends bitwise with a job started on 1 rank from it (itself one process's run to
    fp32 tolerance).

    Node 0's rank fails in its next collective, its agent (`--max-restarts=1`) restarts it, and
    the rendezvous completes without the dead node."""
    node0, node1 = launches["runs"]["elastic"]
    lost, survived = node1.result(), node0.result()
    assert lost.returncode == -signal.SIGKILL, f"node 1's torchrun was not killed: {lost.output}"
    assert survived.returncode == 0 and survived.data, survived.output[-4000:]
    output = survived.output
    assert "Worker group FAILED. 1/1 attempts left; will restart worker group" in output, (
        output[-4000:])
    checkpoint = launches["folders"]["elastic"] / f"step-{ELASTIC_RESUME:08d}"
    assert (f"resumed from {checkpoint}: step {ELASTIC_RESUME}, written by 2 ranks, read by 1"
            in output), output[-4000:]
    assert (survived.data["world_size"], survived.data["start"]) == (1, ELASTIC_RESUME)
    smaller = run_on_ranks(dcp_continue_on_rank, str(checkpoint), ELASTIC_RUN["steps"],
                           world_size=1)[0]
    assert survived.data["parameters_sha256"] == smaller["digest"], (
        "the elastic job, on 1 rank after losing node 1, does not end with the weights of a job "
        f"started on 1 rank from {checkpoint.name}")
    script = load_lesson_module(LESSON, "sharded_checkpoint")  # and that job is the right one
    dataset = CharDataset(32)
    alone, optimizer = script.build(GPTConfig.named("tiny", vocab_size=dataset.vocab_size),
                                    shard=False)
    script.train(alone, optimizer, dataset, 0, ELASTIC_RUN["steps"], 8, share=False)
    assert_parameters_close(smaller["whole"], alone.state_dict(),
                            f"2 ranks to step {ELASTIC_RESUME}, then 1, against one process")


def dcp_continue_on_rank(ctx, checkpoint: str, steps: int) -> dict:
    """A job started on this group from ``checkpoint``, trained up to ``steps``: its model and
    the model's digest."""
    script = load_lesson_module(LESSON, "sharded_checkpoint")
    dataset = CharDataset(32)
    model, optimizer = script.build(GPTConfig.named("tiny", vocab_size=dataset.vocab_size))
    start = script.load(Path(checkpoint), model, optimizer)
    script.train(model, optimizer, dataset, start, steps, 8)
    whole = script.full_state(model)
    return {"whole": whole, "digest": parameter_digest(whole)}


def hang_on_rank(ctx, bug: str, detail: bool = False, monitor: float | None = None,
                 dump_after: float | None = None, folder: str = "") -> dict:
    """find_a_hang.py's step with ``bug`` on a group of its own, with a short timeout (the
    pool's own group stays healthy); returns what each tool said on this rank."""
    script = load_lesson_module(LESSON, "find_a_hang")
    if detail:
        dist.set_debug_level(dist.DebugLevel.DETAIL)  # groups created now check every call
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2))
    dist.set_debug_level(dist.DebugLevel.OFF)
    stacks = Path(folder) / f"stacks-{ctx.rank}.txt" if dump_after else None
    out = open(stacks, "w") if stacks else None
    if out:
        faulthandler.dump_traceback_later(dump_after, exit=False, file=out)
    check_in = script.monitored(monitor, group=group) if monitor else None
    try:
        script.suspect(ctx.rank, bug, check_in, group=group, stuck_for=1.5)
        error = None
    except RuntimeError as err:
        error = str(err)
    finally:
        if out:
            faulthandler.cancel_dump_traceback_later()
            out.close()
    dist.destroy_process_group(group)
    return {"error": error, "stacks": stacks.read_text() if stacks else ""}


@pytest.mark.parametrize("bug, ops", [("order", ("ALLREDUCE", "BROADCAST")),
                                      ("shapes", ("TensorShape=[4]", "TensorShape=[5]")),
                                      ("skipped", ("ALLREDUCE",))])
def test_distributed_debug_detail_names_the_mismatched_calls(bug, ops):
    """Under `TORCH_DISTRIBUTED_DEBUG=DETAIL`, `find_a_hang.py`'s order, shapes and skipped bugs
    raise "Detected mismatch between collectives on ranks" on both of 2 gloo ranks, rank 0's error
    naming the calls; each on a group of its own with a 2-second timeout."""
    ranks = run_on_ranks(hang_on_rank, bug, detail=True, world_size=2)
    for rank, got in enumerate(ranks):
        assert got["error"] and "Detected mismatch between collectives on ranks" in got["error"], (
            f"rank {rank}: {got['error']}")
    assert all(op in ranks[0]["error"] for op in ops), ranks[0]["error"]


def test_monitored_barrier_names_the_straggler_and_the_stacks_show_where_each_rank_is(tmp_path):
    """With `find_a_hang.py`'s straggler on 2 gloo ranks, `monitored_barrier` (0.5 s) names rank 1,
    and `faulthandler`'s watchdog stacks show rank 0 in `monitored_barrier` and rank 1 in
    `load_batch`; on a group of its own with a 2-second timeout."""
    ranks = run_on_ranks(hang_on_rank, "straggler", monitor=0.5, dump_after=0.3,
                         folder=str(tmp_path), world_size=2)
    assert "Ranks 1 failed to pass monitoredBarrier in 500 ms" in (ranks[0]["error"] or ""), (
        ranks[0]["error"])
    # The watchdog's stacks: rank 0 waits in the barrier, rank 1 is stuck reading its data.
    assert "in monitored_barrier" in ranks[0]["stacks"], ranks[0]["stacks"]
    assert "in load_batch" in ranks[1]["stacks"], ranks[1]["stacks"]


def monitored_barrier_on_rank(ctx, wait_all_ranks: bool | None) -> str:
    """Rank 0 alone calls monitored_barrier: every other rank is missing."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=30))
    if ctx.rank != 0:
        return ""
    options = {} if wait_all_ranks is None else {"wait_all_ranks": wait_all_ranks}
    try:
        dist.monitored_barrier(group, timeout=datetime.timedelta(seconds=0.5), **options)
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_monitored_barrier_names_the_first_missing_rank_unless_told_to_wait_for_all():
    """`monitored_barrier` names the first rank that did not come, and every one with
    `wait_all_ranks=True`: 3 gloo ranks, ranks 1 and 2 missing, a 0.5 s timeout."""
    first = run_on_ranks(monitored_barrier_on_rank, None, world_size=3)[0]
    assert "Rank 1 failed to pass monitoredBarrier" in first and "Rank 2" not in first, first
    every = run_on_ranks(monitored_barrier_on_rank, True, world_size=3)[0]
    assert "Ranks 1, 2 failed to pass monitoredBarrier" in every, every


def test_the_workers_meet_at_the_agents_store_unless_sharing_is_off(monkeypatch):
    """The workers' store is the agent's unless `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, and then
    rank 0's: the rendezvous shares its store unless the variable is 1; rank 0's worker, told the
    agent's store is there, only connects, and otherwise starts the server a client reaches.

    09 README, a lost agent: "by default the agent of GROUP_RANK 0 hosts it; with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 ... the worker of rank 0 does"."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
    from torch.distributed.rendezvous import _create_c10d_store

    from harness.launch import free_port

    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    assert DynamicRendezvousHandler.use_agent_store.fget(None)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    assert not DynamicRendezvousHandler.use_agent_store.fget(None)
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    short = datetime.timedelta(seconds=1)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # what the agent says, sharing
    with pytest.raises(Exception):  # noqa: B017 - a timeout or a refused connection: no server
        _create_c10d_store("127.0.0.1", port, 0, 1, short)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # sharing off
    server = _create_c10d_store("127.0.0.1", port, 0, 1, short)
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=short)
    client.set("from a client", "hello")
    assert server.get("from a client") == b"hello"


@pytest.mark.slow  # a torchrun launch
@needs_gpus(1, "nccl and CUDA generators: train_resilient.py killed and restarted on a GPU")
def test_on_a_gpu_a_killed_rank_is_restarted_and_resumes(tmp_path):
    """`train_resilient.py` under `torchrun --max-restarts=1`, one nccl process per GPU (at most
    2), dropout drawing from the CUDA generator: killed after step 5, restarted, resumed from
    step 3, it ends with the weights of a run that never stopped, to fp32 tolerance.

    On a GPU the embedding's backward adds with atomics (an order that varies), hence the
    tolerance."""
    gpus = min(2, torch.cuda.device_count())
    common = ("--epochs", "1", "--batch-size", "4", "--train-windows", "64", "--dropout", "0.1",
              "--save-every", "3", *QUICK_SAMPLE)
    runs = {name: start_script(RESILIENT, *common, *extra, "--checkpoint",
                               str(tmp_path / f"{name}.pt"), launcher="torchrun", nproc=gpus,
                               launcher_args=launcher_args, env=RESTARTABLE, timeout=240)
            for name, extra, launcher_args in (
                ("whole", (), ()),
                ("restarted", ("--checkpoint-dir", str(tmp_path / "ckpt"), "--crash-at-step",
                               "5"), ("--max-restarts=1",)))}
    restarted = runs["restarted"].result()
    assert runs["whole"].result().data["backend"] == "nccl"
    assert "resumed from" in restarted.output and "step-00000003" in restarted.output
    weights = {name: torch.load(tmp_path / f"{name}.pt", weights_only=True)["model"]
               for name in runs}
    assert_parameters_close(weights["restarted"], weights["whole"], "killed and resumed on GPU")


LAB_04 = "lessons/04_pitfalls/labs/04_device_from_rank.py"


@pytest.mark.slow  # four torchrun launches
@pytest.mark.timeout(300)
@needs_gpus(1, "two nodes of one process per GPU: RANK as the GPU index fails on node 1")
def test_on_gpus_two_nodes_make_the_global_rank_a_gpu_this_machine_lacks():
    """Lesson 04's lab as two nodes of one process per GPU on this machine: without `--fix`
    exactly node 1's ranks (G to 2G-1) fail to use `cuda:RANK`; with it, every rank is on its
    `cuda:LOCAL_RANK`.

    Lesson 04's pitfall 4 for real: cuda:RANK does not exist for any of node 1's ranks."""
    gpus = torch.cuda.device_count()
    outcomes = {}
    for fix in (False, True):
        agents = start_nodes(LAB_04, *(["--fix"] if fix else []), nproc=gpus, job=f"lab{fix}",
                             timeout=120)
        outcomes[fix] = [agent.result() for agent in agents][0].data
    ranks = outcomes[False]["ranks"]
    failed = sorted(r["rank"] for r in ranks if "rank_as_gpu_error" in r)
    assert failed == list(range(gpus, 2 * gpus)), (
        f"with {gpus} GPU(s), node 1's ranks {gpus}..{2 * gpus - 1} should fail to use cuda:RANK; "
        f"failed: {failed}; {ranks}")
    assert outcomes[False]["symptom"] and "asked for cuda:" in outcomes[False]["verdict"]
    fixed = outcomes[True]
    assert not fixed["symptom"], fixed["verdict"]
    assert [r["bare_cuda_tensor"] for r in fixed["ranks"]] == [
        f"cuda:{r['local_rank']}" for r in fixed["ranks"]], fixed["ranks"]


def test_zip_archives_cut_short_do_not_open(tmp_path):
    # What resume_point relies on (asked of torch and zipfile, not assumed): torch.save writes
    # a zip archive whose index is at the end, so a file cut short is not one, and torch.load
    # refuses it.
    """A `train.pt` cut short (by one byte, to half, to 10 bytes) is not a zip archive for
    `zipfile.is_zipfile`, and `torch.load` refuses it: what `resume_point` relies on, asked of
    both."""
    path = write_checkpoint(tmp_path, 1) / "train.pt"
    assert zipfile.is_zipfile(path)
    data = path.read_bytes()
    for keep in (len(data) - 1, len(data) // 2, 10):
        path.write_bytes(data[:keep])
        assert not zipfile.is_zipfile(path), keep
        with pytest.raises(Exception):  # noqa: B017 - RuntimeError or EOFError, by version
            torch.load(path, weights_only=True)
