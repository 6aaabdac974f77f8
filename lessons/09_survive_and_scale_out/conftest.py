"""Lesson 09's fixtures, shared by its test files: ``ex`` (the graded exercises) and
``launches``, the torchrun runs of the lesson's script checks, started in the background
before the lesson's first test (in whichever file) when a selected test uses them."""

from __future__ import annotations

import pytest

from harness.exercises import REPO_ROOT, load_exercise
from harness.launch import (
    QUICK_SAMPLE,
    free_port,
    path_with,
    start_first,
    start_nodes,
    start_script,
)
from lesson09.common import (
    ELASTIC,
    ELASTIC_RDZV,
    LAUNCH_TIMEOUT,
    LESSON,
    PREEMPTED,
    RESILIENT,
    RESTARTABLE,
    SBATCH,
    SHARDED,
)


@pytest.fixture
def ex():
    return load_exercise(LESSON)


start_launches_first = start_first("launches", __file__)  # while the other checks run


@pytest.fixture(scope="session")
def launches(tmp_path_factory):
    """The torchrun runs of test_09_survive_and_scale_out.py's script checks, started
    together."""
    folders = {name: tmp_path_factory.mktemp(name) for name in ("restart", "no-restart")}
    # gloo on the CPU, as the pooled reference trains, on a GPU machine too: there two nodes on
    # one machine would be two nccl ranks on cuda:0, which NCCL refuses (the GPU test of
    # test_09_survive_and_scale_out.py runs the restart on GPUs).
    common = ("--backend", "gloo", "--epochs", "1", "--batch-size", "4", "--train-windows", "64",
              "--dropout", "0.1", "--save-every", "3", *QUICK_SAMPLE)
    runs = {
        "restart": start_script(RESILIENT, *common, "--checkpoint-dir", str(folders["restart"]),
                                "--crash-at-step", "5", launcher="torchrun", nproc=2,
                                launcher_args=("--max-restarts=1",), env=RESTARTABLE,
                                timeout=LAUNCH_TIMEOUT),
        # One process: the last rank is rank 0, and one fewer process to start.
        "no-restart": start_script(RESILIENT, *common, "--checkpoint-dir",
                                   str(folders["no-restart"]), "--crash-at-step", "5",
                                   launcher="torchrun", nproc=1, check=False,
                                   timeout=LAUNCH_TIMEOUT),
    }
    # Two nodes on this machine: the batch script, with stand-ins for sbatch (slurm/sbatch) and
    # srun (slurm/srun, one task per emulated node, hosts 127.0.0.1 and 127.0.0.2, each a
    # torchrun of one process). Once step 3 is saved, sbatch's stand-in signals the batch shell
    # as SLURM does before the time limit; the job stops, requeues itself, starts again, resumes.
    def batch_job(script, checkpoints, job_id: str, **launch):
        """The batch script under sbatch's stand-in, signalled once step 3 is saved."""
        return start_script(
            f"lessons/{LESSON}/slurm/sbatch", str(script), *PREEMPTED, launcher="bash",
            timeout=LAUNCH_TIMEOUT, **launch,
            env={"PATH": path_with(REPO_ROOT / SBATCH.rsplit("/", 1)[0]), "SAVE_EVERY": "3",
                 "MASTER_PORT": str(free_port()), "SLURM_JOB_ID": job_id,
                 "FAKE_SLURM_NODES": "2", "CHECKPOINTS": str(checkpoints),
                 "FAKE_SLURM_SIGNAL_WHEN": str(checkpoints / "step-00000003")})

    folders["two nodes"] = tmp_path_factory.mktemp("slurm")
    runs["two nodes"] = batch_job(SBATCH, folders["two nodes"], "4242")
    # The recipe real srun breaks, under the stand-in that behaves as it: the batch script whose
    # trap passes the warning on as SIGTERM to srun, stopped there (no requeue, no second run).
    old_recipe = tmp_path_factory.mktemp("sigterm-to-srun") / "train.sbatch"
    text = (REPO_ROOT / SBATCH).read_text()
    for was, becomes in (("kill -USR1 \"$srun_pid\"", "kill -TERM \"$srun_pid\""),
                         ("exec scontrol requeue \"$SLURM_JOB_ID\"", "exit \"$status\"")):
        assert was in text, f"{SBATCH} no longer holds {was!r}: update the old recipe's test"
        text = text.replace(was, becomes)
    old_recipe.write_text(text)
    folders["sigterm to srun"] = old_recipe.parent / "checkpoints"
    runs["sigterm to srun"] = batch_job(old_recipe, folders["sigterm to srun"], "4243",
                                        result=False, check=False)
    # An elastic job of two nodes (agents) on this machine: node 1 is lost after step 5, its
    # agent and its process killed at once; node 0's agent restarts its process alone.
    folders["elastic"] = tmp_path_factory.mktemp("elastic")
    runs["elastic"] = start_nodes(
        SHARDED, *ELASTIC, "--checkpoint-dir", str(folders["elastic"]), min_nodes=1,
        rdzv_conf=ELASTIC_RDZV, launcher_args=("--max-restarts=1",), job="elastic", check=False,
        env=RESTARTABLE, timeout=LAUNCH_TIMEOUT)
    yield {"runs": runs, "folders": folders}
    for run in runs.values():
        for launch in run if isinstance(run, list) else [run]:
            launch.stop()
