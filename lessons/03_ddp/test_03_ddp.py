"""Lesson 03's own checks: what the README claims of DistributedSampler and of DDP, and the
training script under every launcher. Each task's grader is its own file beside this one,
test_03_K_<topic>.py (pytest lessons/03_ddp -m task3_K).

The equalities this lesson rests on are checked against a single process:
W ranks with per-rank batch b, averaging gradients, take exactly the steps of one process with
batch W*b, provided every global batch is the same set of samples.

    pytest lessons/03_ddp/test_03_ddp.py
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from gpt import GPT, SIZES, CharDataset, GPTConfig, load_text, parameter_digest, train_val_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from harness.compare import assert_close, assert_parameters_close, full_fp32
from harness.exercises import load_lesson_module
from harness.hardware import needs_gpus
from harness.launch import QUICK_SAMPLE, run_script, start_script
from harness.ranks import run_on_ranks
from lesson03.common import (
    EPOCHS,
    GROUPS,
    LESSON,
    make_data,
    make_model,
    my_share,
    one_process_on_global_batches,
    sampler_indices,
    single_process_gradients,
    train_epochs,
    with_diagnosis,
)

SCRIPT = f"lessons/{LESSON}/train_ddp.py"


# ----------------------------------------------------------------------------- the sampler


@pytest.mark.parametrize("length,world", [(10, 3), (2, 4), (7, 2), (12, 4)])
def test_distributed_sampler_shards_have_equal_length_and_cover_the_data(length, world):
    """DistributedSampler gives every rank ceil(N / W) indices, covering every sample, with exactly
    ceil(N / W) * W - N repeats as padding: 10 samples on 3 ranks, 2 on 4, 7 on 2 and 12 on 4."""
    shards = [sampler_indices(length, world, r) for r in range(world)]
    per_rank = -(-length // world)  # ceil
    assert all(len(s) == per_rank for s in shards), "every rank gets the same number"
    everything = sorted(i for s in shards for i in s)
    assert set(everything) == set(range(length)), "every sample is seen"
    padding = per_rank * world - length
    assert len(everything) - length == padding, "exactly enough repeats to even the shards"


@pytest.mark.parametrize("length,world", [(10, 3), (7, 2), (12, 4)])
def test_distributed_sampler_with_drop_last_is_disjoint(length, world):
    """With drop_last=True, DistributedSampler's shards share no sample and hold (N // W) * W
    samples in all, the tail dropped: 10 samples on 3 ranks, 7 on 2 and 12 on 4."""
    shards = [sampler_indices(length, world, r, drop_last=True) for r in range(world)]
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)), "no sample twice"
    assert len(flat) == (length // world) * world, "the tail that does not divide is dropped"


def test_distributed_sampler_order_changes_with_epoch_and_agrees_across_ranks():
    """DistributedSampler's order for 20 samples on 2 ranks differs between epochs 0 and 1, and in
    each epoch the 2 shards interleave back into one permutation of all 20: the ranks share one
    order."""
    epoch0 = [sampler_indices(20, 2, r, epoch=0) for r in range(2)]
    epoch1 = [sampler_indices(20, 2, r, epoch=1) for r in range(2)]
    assert epoch0 != epoch1, "set_epoch must reshuffle"
    # Same permutation on every rank: interleaving the shards rebuilds one permutation.
    for shards in (epoch0, epoch1):
        rebuilt = [shards[i % 2][i // 2] for i in range(20)]
        assert sorted(rebuilt) == list(range(20))
    assert sampler_indices(20, 2, 0, epoch=1) == sampler_indices(20, 2, 0, epoch=1)


# ----------------------------------------------------------------------------- real DDP


def ddp_gradients(ctx, inputs, targets):
    with full_fp32():  # compared with a CPU run: no TF32
        model = make_model(seed=ctx.rank)  # different on purpose: DDP broadcasts rank 0's weights
        model = DDP(model.to(ctx.device),
                    device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        x, y = my_share(ctx, inputs, targets)
        nn.functional.mse_loss(model(x), y).backward()
        return {name: p.grad for name, p in model.module.named_parameters()}


@pytest.mark.parametrize("group", GROUPS)
def test_ddp_gradients_equal_one_process_on_the_whole_batch(group):
    """DDP's gradients, on ranks whose models start from different seeds, equal one process's on the
    whole batch (4 samples per rank, fp32 tolerance): on 2 and 3 gloo ranks on the CPU, and on GPUs.

    The different seeds show that DDP broadcasts rank 0's parameters. The GPU cases: 2 gloo ranks
    sharing cuda:0, and nccl with one rank per GPU."""
    world, backend, device = group
    inputs, targets = make_data(4 * world)
    expected = single_process_gradients(inputs, targets)
    results = run_on_ranks(ddp_gradients, inputs, targets, world_size=world, backend=backend,
                           device=device)
    for rank, grads in enumerate(results):
        assert_parameters_close(grads, expected, rank=rank, what="DDP gradient")


@pytest.mark.parametrize("group", GROUPS)
def test_ddp_trajectory_equals_one_process_on_global_batches(group):
    """Two epochs of DDP with a DistributedSampler (36 samples, batches of 3 per rank, SGD) leave
    the parameters of one process reading the same global batches, to fp32 tolerance: on 2 and 3
    gloo ranks on the CPU, and on GPUs.

    36 divides by 2 and 3, so no sample is padded in. The GPU cases: 2 gloo ranks sharing cuda:0,
    and nccl with one rank per GPU."""
    world, backend, device = group
    expected_params, _ = one_process_on_global_batches(world)
    results = run_on_ranks(train_epochs, use_exercise=False, world_size=world, backend=backend,
                           device=device)
    for rank, result in enumerate(results):
        assert_parameters_close(result["parameters"], expected_params, rank=rank,
                                what=f"DDP parameter after {EPOCHS} epochs")


# ----------------------------------------------------------------------------- the script

# The script is lesson 00's train.py plus DDP. Its runs are compared through what they write:
# the --result JSON (rank 0's) and the --checkpoint file, a plain GPT state_dict.

# One epoch over the first 320 windows (of 1010): 20 steps of a global batch of 16, about 0.5 s
# of training per run; the rest of each launch is starting processes and importing torch.
TRAIN_ONE_EPOCH = ("--epochs", "1", "--train-windows", "320", *QUICK_SAMPLE)
# Two runs that take the same steps agree to fp32 rounding, which AdamW then amplifies where a
# gradient is rounding noise: the key projections' biases get none at all in exact arithmetic
# (a bias added to every key shifts a query's scores equally, and softmax ignores that: they
# change no output), yet AdamW steps on the noise. Measured between 2 ranks x 8 and 1 process
# x 16 after one epoch: up to 9e-5 on those biases, 3e-5 elsewhere. One process reading the
# same windows in another order ends up to 0.1 and more away.
SAME_STEPS = {"rtol": 1e-3, "atol": 2e-4}
# CUDA kernels add in another order than the CPU's: the losses then agree to 1e-4, not 1e-6.
CUDA_VS_CPU = {"rtol": 1e-4, "atol": 1e-5}


def trained(checkpoint) -> dict[str, torch.Tensor]:
    """A checkpoint written by the script: a plain state_dict, loaded without unpickling code."""
    return torch.load(checkpoint, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory):
    """The training script under every launcher, all started at once (most of each launch is
    importing torch, which overlaps well), each with a global batch of 16 and its own
    checkpoint folder. Yields (launches, checkpoint paths), both keyed by launcher.

    The one-process run is the reference, on the CPU (gloo) on every machine: left to choose,
    it would take a GPU wherever there is one, while 2 ranks with fewer than 2 GPUs take the
    CPU. The 2-rank runs choose for themselves, as a learner's would."""
    folder = tmp_path_factory.mktemp("checkpoints")
    checkpoints = {name: folder / name / "model.pt"
                   for name in ("python", "torchrun", "launch", "spawn")}

    def save_to(name):
        return ("--checkpoint", str(checkpoints[name]))

    runs = {
        "python": start_script(SCRIPT, *TRAIN_ONE_EPOCH, "--batch-size", "16", "--backend",
                               "gloo", *save_to("python")),
        "torchrun": start_script(SCRIPT, *TRAIN_ONE_EPOCH, "--batch-size", "8",
                                 *save_to("torchrun"), launcher="torchrun", nproc=2),
        # python -m torch.distributed.launch, which passes --local-rank=N
        "launch": start_script(SCRIPT, *TRAIN_ONE_EPOCH, "--batch-size", "8",
                               *save_to("launch"), launcher="launch", nproc=2),
        "spawn": start_script(f"lessons/{LESSON}/train_spawn.py", "--nprocs", "2",
                              *TRAIN_ONE_EPOCH, "--batch-size", "8", *save_to("spawn")),
    }
    yield runs, checkpoints
    for run in runs.values():
        run.stop()


def assert_same_training(run, single, what: str) -> None:
    """``run`` took the steps of the one-process run ``single``: the same loss per epoch, on
    the training windows (as reported) and on the validation windows (of the trained model)."""
    __tracebackhide__ = True
    tolerances = CUDA_VS_CPU if run.data["device"] != single.data["device"] else {}
    try:
        assert_close(torch.tensor(run.data["val_loss"]), torch.tensor(single.data["val_loss"]),
                     f"{what}: val_loss per epoch", **tolerances)
    except AssertionError as error:
        raise with_diagnosis(
            error, "the trained models differ, so the ranks did not take the one process's "
            "steps: each rank must read its own share of every global batch (a "
            "DistributedSampler, seeded alike on every rank) and train through the DDP "
            "wrapper") from None
    try:
        assert_close(torch.tensor(run.data["train_loss"]),
                     torch.tensor(single.data["train_loss"]), f"{what}: train_loss per epoch",
                     **tolerances)
    except AssertionError as error:
        raise with_diagnosis(
            error, "the models agree but the reported training loss does not: it must be the "
            "mean over every rank's windows (all-reduce the loss sum and the sample count), "
            "not rank 0's own") from None


@pytest.mark.slow
def test_script_under_torchrun_equals_single_process(script_runs):
    """train_ddp.py under torchrun, 2 ranks x 8 for one epoch of 320 windows, gives the training and
    validation losses of one python process x 16 on the CPU (gloo) to fp32 tolerance, 1e-4 when its
    ranks use 2 GPUs, and its checkpoint the same weights to 1e-3 (relative), 2e-4 (absolute).

    The weights' tolerance: AdamW steps on rounding noise in the attention's key biases, whose true
    gradient is zero (measured: up to 9e-5 apart)."""
    runs, checkpoints = script_runs
    run, single = runs["torchrun"].result(), runs["python"].result()
    assert (single.data["world_size"], single.data["batch_size"], single.data["device"]) == (
        1, 16, "cpu"), single.data
    assert (run.data["world_size"], run.data["batch_size"]) == (2, 8), (
        "expected 2 ranks with 8 samples each (--batch-size is per process), got "
        f"world_size {run.data['world_size']}, batch_size {run.data['batch_size']}")
    assert run.data["backend"] == ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
    # The sharp check: the epoch's mean loss over all 1010 windows, to fp32 rounding (on the
    # CPU; 2 ranks on 2 GPUs are compared with the CPU run to CUDA_VS_CPU).
    assert_same_training(run, single, "2 ranks x 8 vs 1 process x 16")
    assert_parameters_close(trained(checkpoints["torchrun"]), trained(checkpoints["python"]),
                            what="trained parameter, 2 ranks x 8 vs 1 process x 16",
                            **SAME_STEPS)


@pytest.mark.slow
def test_script_under_torchrun_prints_and_saves_on_rank_0_only(script_runs):
    """Under torchrun with 2 ranks, only rank 0 prints progress and saves the checkpoint, once: its
    folder holds model.pt alone, the file loads strictly into a plain GPT (no module. prefix), and
    its sha256 is the one rank 0 reported."""
    runs, checkpoints = script_runs
    run = runs["torchrun"].result()
    assert any("epoch 1/1" in line for line in run.rank_lines(0)), run.output
    said = [line for line in run.rank_lines(1)
            if any(word in line for word in ("epoch", "sample", "checkpoint", "result"))]
    assert not said, f"rank 1 printed progress; only rank 0 should: {said}"
    saved = [line for line in run.output.splitlines() if "checkpoint saved" in line]
    assert len(saved) == 1 and saved[0].startswith("[default0]:"), (
        f"the checkpoint should be saved once, by rank 0: {saved}")
    # Exactly one file, complete (no .partial left), loadable into a plain GPT: no "module.".
    folder = checkpoints["torchrun"].parent
    assert sorted(p.name for p in folder.iterdir()) == ["model.pt"]
    vocab_size = CharDataset(SIZES["tiny"]["block_size"]).vocab_size
    model = GPT(GPTConfig.named("tiny", vocab_size=vocab_size))
    model.load_state_dict(trained(checkpoints["torchrun"]))  # strict: every name must match
    # The digest rank 0 reported is that of the weights in the file, to the bit.
    assert parameter_digest(model) == run.data["params_sha256"]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["launch", "spawn"])
def test_older_launchers_train_the_same_model(script_runs, launcher):
    """train_ddp.py under python -m torch.distributed.launch, and train_spawn.py under mp.spawn, 2
    ranks x 8, give the losses and the weights of one python process x 16, as under torchrun."""
    runs, checkpoints = script_runs
    run, single = runs[launcher].result(), runs["python"].result()
    assert (run.data["world_size"], run.data["batch_size"]) == (2, 8), run.data
    assert_same_training(run, single, f"{launcher}, 2 ranks x 8 vs 1 process x 16")
    assert_parameters_close(trained(checkpoints[launcher]), trained(checkpoints["python"]),
                            what=f"trained parameter under {launcher}", **SAME_STEPS)


@pytest.mark.slow
@needs_gpus(1, "nccl world 1 under torchrun")
def test_script_on_a_gpu_equals_the_cpu_run(script_runs, tmp_path):
    """train_ddp.py under torchrun on 1 GPU (nccl, cuda:0, batch 16) gives the CPU run's training
    and validation losses (to 1e-4, relative) and weights (to 1e-3 relative, 2e-4 absolute)."""
    runs, checkpoints = script_runs
    single = runs["python"].result()
    checkpoint = tmp_path / "gpu.pt"
    run = run_script(SCRIPT, *TRAIN_ONE_EPOCH, "--batch-size", "16", "--checkpoint",
                     str(checkpoint), launcher="torchrun", nproc=1)
    assert run.data["backend"] == "nccl" and run.data["device"] == "cuda:0", run.data
    for key in ("train_loss", "val_loss"):
        assert_close(torch.tensor(run.data[key]), torch.tensor(single.data[key]),
                     f"GPU vs CPU: {key} per epoch", **CUDA_VS_CPU)
    assert_parameters_close(trained(checkpoint), trained(checkpoints["python"]),
                            what="trained parameter, GPU vs CPU", **SAME_STEPS)


SHORT_TEXT = 2000  # characters: 56 training windows of 32, 28 per rank


def windows_read(ctx, epochs: int) -> list[int]:
    """Run the script's fit() on this pooled rank, on a short text; return the indices of the
    dataset's windows in the order this rank read them (training and validation)."""
    train = load_lesson_module(LESSON, "train_ddp")
    read: list[int] = []

    class Recorded(CharDataset):
        def __getitem__(self, i):
            read.append(int(i))
            return super().__getitem__(i)

    def recorded_windows(size: str, train_windows=None):  # gpt.run.windows, on the short text
        dataset = Recorded(SIZES[size]["block_size"], text=load_text()[:SHORT_TEXT])
        return (dataset, *train_val_split(dataset))

    real = train.run.windows  # gpt.run, the module the script calls it from
    train.run.windows = recorded_windows
    try:
        train.fit(ctx.device, epochs=epochs, batch_size=4, log=lambda *args, **kwargs: None)
    finally:
        train.run.windows = real
    return read


def per_epoch(read: list[int], n_train: int) -> list[list[int]]:
    """The training windows read in each epoch: the runs of indices below ``n_train``."""
    epochs, current = [], []
    for i in [*read, n_train]:  # validation windows (n_train and up) end an epoch
        if i < n_train:
            current.append(i)
        elif current:
            epochs.append(current)
            current = []
    return epochs


def test_script_reads_its_own_shard_in_a_new_order_every_epoch():
    """In each of 2 epochs of train_ddp.py's fit() on 2 gloo ranks, on a short text, the ranks read
    the training windows in two disjoint halves, and each rank reads another order in epoch 2 than
    in epoch 1.

    What the equality with one process cannot show: both runs share the script, so a script
    that forgets set_epoch repeats epoch 1's order in both. Read the order itself."""
    n_train = len(train_val_split(CharDataset(SIZES["tiny"]["block_size"],
                                              text=load_text()[:SHORT_TEXT]))[0])
    reads = run_on_ranks(windows_read, 2, world_size=2)
    epochs = [per_epoch(read, n_train) for read in reads]
    for rank, shards in enumerate(epochs):
        assert len(shards) == 2, f"rank {rank} read training windows in {len(shards)} epochs, not 2"
    for epoch in range(2):
        shards = [epochs[rank][epoch] for rank in range(2)]
        assert sorted(shards[0] + shards[1]) == list(range(n_train)), (
            f"epoch {epoch + 1}: the 2 ranks read {len(shards[0])} and {len(shards[1])} training "
            f"windows, not each its own half of the {n_train}: a DistributedSampler shards them")
    for rank in range(2):
        assert epochs[rank][0] != epochs[rank][1], (
            f"rank {rank} read the same windows in the same order in epochs 1 and 2: call "
            f"train_loader.sampler.set_epoch(epoch) before each epoch")


@pytest.fixture
def train_script(outside_launcher):
    """train_ddp.py, imported, to call its main() as plain python would run it."""
    return load_lesson_module(LESSON, "train_ddp")


def usage_error(train, argv: list[str], capsys) -> str:
    """Call the script's main(argv), which must refuse: return 2, say why in one line on
    stderr, and leave no process group behind. Returns that line."""
    __tracebackhide__ = True
    code = train.main(argv)
    err = capsys.readouterr().err
    assert code == 2, f"main({argv}) returned {code!r}, not 2 (a usage error). stderr: {err}"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and re.match(r"\S+\.py: error: ", lines[0]), (
        f"expected one line 'train.py: error: ...' on stderr, got {lines}")
    assert not dist.is_initialized(), (
        "main returned with a process group still initialised: check before joining one")
    return lines[0]


def test_script_explains_a_partial_launcher_environment(train_script, monkeypatch, capsys):
    """train_ddp.py with only RANK and WORLD_SIZE set exits with code 2 and one line, "train_ddp.py:
    error: ...", naming LOCAL_RANK, MASTER_ADDR, MASTER_PORT and torchrun, with no process group
    left."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    message = usage_error(train_script, [], capsys)
    assert all(name in message for name in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")), message
    assert "torchrun" in message, message


def test_script_explains_nccl_without_gpus(train_script, monkeypatch, capsys):
    """train_ddp.py --backend nccl without CUDA (faked) exits with code 2 and one error line that
    says "needs CUDA GPUs" and "0 GPU(s)", with no process group left."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    message = usage_error(train_script, ["--backend", "nccl"], capsys)
    assert "needs CUDA GPUs" in message and "0 GPU(s)" in message, message


def test_script_explains_more_ranks_than_gpus(train_script, monkeypatch, capsys):
    """train_ddp.py --backend nccl with 4 local processes and 2 GPUs (faked) exits with code 2 and
    one error line, "4 processes on this machine, 2 GPU(s) visible", with no process group left."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # never reached: fails before
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    message = usage_error(train_script, ["--backend", "nccl"], capsys)
    assert "4 processes on this machine, 2 GPU(s) visible" in message, message


def test_the_script_and_the_exercise_name_the_same_launcher_variables(ex):
    """train_ddp.py (through gpt.run's setup) and the exercises name the same LAUNCHER_VARIABLES,
    so the script checks the environment task3_2 checks."""
    assert load_lesson_module(LESSON, "train_ddp").run.LAUNCHER_VARIABLES == ex.LAUNCHER_VARIABLES
