"""Lesson 06: tensor parallelism. Layers split by hand, then with DTensor, then 2-D with FSDP2.

What the lesson rests on, checked on gloo/CPU ranks (and on CUDA where present):
- a split layer computes what the whole layer computes: outputs, the input's gradient and the
  weights' gradients, reassembled from every rank's slice, equal the unsplit layer's;
- the split running example trains as the unsplit one does, step after step;
- each forward and backward runs the collectives the text counts, and moves the bytes it says,
  counted by wrapping the collectives (``harness.collectives``) or by torch's ``CommDebugMode``.

Each task's tests are in its own file, test_06_1_conjugates.py to test_06_5_2d.py (what they
share is in common.py and conftest.py); this file checks the lesson's script, train_tp.py:

    pytest lessons/06_tensor_parallel/test_06_tensor_parallel.py
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from gpt import GPT, SIZES, CharDataset, GPTConfig, parameter_digest

from harness.compare import assert_close, assert_parameters_close
from harness.exercises import load_lesson_module
from harness.hardware import gpu_marks
from harness.launch import one_process_fit, run_script
from harness.ranks import run_on_ranks
from lesson06.common import LESSON, SCRIPT, TRAIN

# Each task's CLAUSES (its contract, clause by clause, and the tests that fail when only that
# clause is broken) are in the task's file; tests/test_course.py merges them and checks the names.


# train_tp.py is lesson 05's train_fsdp.py with tensor parallelism inside FSDP2. It runs under
# the real torchrun on 4 ranks, dp 2 x tp 2 with batch 8 per data-parallel row (tp 2 alone is
# the same code with dp 1; the course's integrity tests launch that too). It must take the steps
# of one process on batches of 16: lesson 03's fit(), on a pooled rank. That run (TRAIN, in
# common.py: 4 steps of 16 windows) is conftest.py's script_run, started in the background before
# the lesson's first test.

# Another summation order, with AdamW amplifying rounding where a gradient is rounding noise
# (lesson 03 measured this bound).
SAME_STEPS = {"rtol": 1e-3, "atol": 2e-4}
TINY_PARAMETERS = 55_808


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(one_process_fit, 64, world_size=1, timeout=120)[0]


def assert_trains_like_one_process(data: dict, weights: dict, reference: dict, what: str):
    __tracebackhide__ = True
    for key in ("train_loss", "val_loss"):
        assert_close(torch.tensor(data[key]), torch.tensor(reference["result"][key]),
                     f"{what} vs one process x 16: {key} per epoch", **SAME_STEPS)
    assert_parameters_close(weights, reference["state"], what=f"trained parameter, {what} vs "
                            "one process", **SAME_STEPS)
    one = reference["result"]["sample_before"]
    assert data["sample_before"] == one, (
        f"{what}: sampled {data['sample_before']!r} before training, one process {one!r}")
    vocab_size = CharDataset(SIZES["tiny"]["block_size"]).vocab_size
    model = GPT(GPTConfig.named("tiny", vocab_size=vocab_size))
    model.load_state_dict(weights)
    assert parameter_digest(model) == data["params_sha256"], (
        f"{what}: the digest rank 0 reported is not that of the weights it gathered")


@pytest.mark.slow
def test_script_2d_on_four_ranks_trains_what_one_process_trains(script_run, reference):
    """train_tp.py under torchrun on 4 ranks, dp 2 × tp 2 with 8 windows per row, takes the steps of
    lesson 03's script in one process on batches of 16: losses and gathered parameters to lesson
    03's bound, the sample before training, and each rank's parameter bytes within 10% of the
    split's."""
    launch, checkpoint = script_run
    run = launch.result()
    assert (run.data["world_size"], run.data["dp"], run.data["tp"]) == (4, 2, 2), run.data
    weights = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert_trains_like_one_process(run.data, weights, reference, "dp 2 x tp 2, 8 per row")
    # What the blocks split (weights, and the column-parallel layers' biases: 50,048 of the
    # 55,808 parameters) is cut 4 ways, the rest 2 ways; FSDP's padding aside.
    split = 4 * (12 * 32 * 32 + 3 * 32 + 4 * 32)
    expected = 4 * (split / 4 + (TINY_PARAMETERS - split) / 2)
    for rank, sizes in enumerate(run.data["bytes_per_rank"]):
        assert abs(sizes["parameters"] - expected) <= 0.1 * expected, (
            f"rank {rank} stores {sizes['parameters']} bytes of parameters, expected about "
            f"{expected:.0f}: {sizes}")
    assert "dp 2 x tp 2" in run.output and not [line for line in run.rank_lines(1)
                                                   if "epoch" in line], run.output


# CUDA kernels add in another order than the CPU's (lesson 03 measured the same bound).
CUDA_VS_CPU = {"rtol": 1e-4, "atol": 1e-5}


@pytest.mark.slow
@pytest.mark.parametrize("gpus", [pytest.param(n, marks=gpu_marks(n, f"nccl, tp {n}"),
                                               id=f"tp{n}") for n in (1, 2)])
def test_script_on_gpus_trains_what_one_process_trains_on_the_cpu(reference, gpus):
    """train_tp.py on 1 and 2 GPUs (nccl, one GPU per rank, every rank in one TP group) gives the
    losses of lesson 03's one-process CPU run on batches of 16, to CUDA's rounding (rtol 1e-4, atol
    1e-5)."""
    run = run_script(SCRIPT, *TRAIN, "--batch-size", "16", launcher="torchrun", nproc=gpus)
    assert (run.data["backend"], run.data["device"], run.data["tp"]) == ("nccl", "cuda:0",
                                                                         gpus), run.data
    for key in ("train_loss", "val_loss"):
        assert_close(torch.tensor(run.data[key]), torch.tensor(reference["result"][key]),
                     f"tp {gpus} on GPUs vs one CPU process x 16: {key}", **CUDA_VS_CPU)


@pytest.fixture
def train_script(outside_launcher):
    """train_tp.py, imported, to call its main() as plain python would run it."""
    return load_lesson_module(LESSON, "train_tp")


def test_script_refuses_a_tp_degree_that_does_not_fit(train_script, capsys):
    """train_tp.py as one plain process with `--tp 2` exits with status 2 and one line naming `--tp
    2` and 1 process, before any process group."""
    assert train_script.main(["--tp", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tp 2" in err[0] and "1 process" in err[0], err
    assert not dist.is_initialized()


def test_script_names_the_default_tp_degree_and_what_it_must_divide(train_script, monkeypatch,
                                                                     capsys):
    """With 8 processes and no `--tp`, train_tp.py exits with status 2 and one line: the default
    `--tp 8` (every process) cannot split the tiny model's 4 heads; try `--tp 4`."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert train_script.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tp 8 (the default: every process)" in err[0], err
    assert "4 heads" in err[0] and "try --tp 4" in err[0] and "processes" not in err[0], err


def test_script_explains_a_partial_launcher_environment(train_script, monkeypatch, capsys):
    """train_tp.py with RANK and WORLD_SIZE set but not LOCAL_RANK exits with status 2 and one line
    naming LOCAL_RANK and the script."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train_script.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "LOCAL_RANK" in err[0] and "train_tp.py" in err[0], err
