"""Lesson 01: checks the lesson's claims about ``nn.DataParallel``, and its scripts.

The hand-made data parallelism (the tasks) is graded in test_01_1_2_scatter.py (task1_1,
task1_2), test_01_3_4_replicate_and_gather.py (task1_3, task1_4) and
test_01_5_6_reduce_and_step.py (task1_5, task1_6).

    pytest lessons/01_data_parallel               # your exercises, and the lesson's claims
    pytest lessons/01_data_parallel -m task1_6    # one task
    pytest lessons/01_data_parallel -m gpu        # only the checks of the real nn.DataParallel

Without a GPU, ``nn.DataParallel`` does not split anything (it calls the module once), so the
checks of the real thing skip with the hardware they need; the hand-made version is what runs.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.compare import assert_close, assert_parameters_close, full_fp32
from harness.exercises import LESSONS_DIR, load_lesson_module
from harness.hardware import cuda_device_count, gpu_marks, needs_gpus
from harness.launch import run_script
from lesson01.common import (
    BASE_LESSON,
    LESSON,
    TRAIN_ARGS,
    TinyNet,
    chunk_sizes,
    make_batch,
    seen_batch_sizes,
)


@pytest.fixture(scope="module")
def train():
    """The lesson's train.py, imported (the same file in both modes)."""
    return load_lesson_module(LESSON, "train")


# --------------------------------------------------------------------------------------------
# The lesson's claims that hold on any machine.


def test_readme_split_table_is_tensor_chunk():
    """The splits the README lists are the ones Tensor.chunk (DataParallel's scatter) makes."""
    table = {(12, 3): [4, 4, 4], (10, 3): [4, 4, 2], (10, 4): [3, 3, 3, 1], (5, 4): [2, 2, 1],
             (6, 4): [2, 2, 2], (2, 3): [1, 1], (10, 8): [2, 2, 2, 2, 2]}
    for (batch_size, devices), sizes in table.items():
        assert chunk_sizes(batch_size, devices) == sizes, (batch_size, devices)


@pytest.mark.skipif(
    cuda_device_count() > 0,
    reason="needs a machine without a CUDA GPU (with one, DataParallel splits the batch; "
           "the gpu checks cover that)",
)
def test_data_parallel_is_a_pass_through_without_gpus():
    """Without a CUDA GPU, nn.DataParallel is a pass-through: it keeps device_ids [] and calls the
    module once on the whole batch of 10, and outputs and gradients equal an unwrapped copy's bit
    for bit."""
    model = TinyNet()
    wrapped = nn.DataParallel(model)
    inputs, targets = make_batch(10)
    outputs = wrapped(inputs)
    assert wrapped.device_ids == [], f"DataParallel chose device_ids {wrapped.device_ids}"
    assert seen_batch_sizes() == [10], (
        f"without GPUs DataParallel should call the module once with the whole batch; it ran "
        f"on {seen_batch_sizes()}"
    )
    reference = copy.deepcopy(model)
    F.mse_loss(outputs, targets).backward()
    F.mse_loss(reference(inputs), targets).backward()
    assert torch.equal(outputs, reference(inputs))
    assert_parameters_close(model, reference, grads=True, rtol=0, atol=0)


def test_batchnorm_in_training_sees_only_its_chunk():
    """BatchNorm in training mode normalises each chunk with that chunk's own statistics: 10
    samples in 3 chunks, each on its own copy, give other outputs than the whole batch; in eval
    mode, the same outputs.

    So "equal to one device" needs a model whose samples do not interact."""
    bn = nn.BatchNorm1d(4)
    x = torch.randn(10, 4, generator=torch.Generator().manual_seed(6)) * 3 + 1
    whole = bn(x)
    per_chunk = torch.cat([copy.deepcopy(bn)(c) for c in x.chunk(3)])
    assert not torch.allclose(whole, per_chunk, atol=1e-3)
    bn.eval()
    assert_close(torch.cat([bn(c) for c in x.chunk(3)]), bn(x), "BatchNorm in eval mode")


# --------------------------------------------------------------------------------------------
# The real nn.DataParallel on GPUs: one GPU listed twice, and every GPU.


@pytest.fixture
def no_tf32():
    """Full fp32 matmuls while GPU results are compared with CPU ones (TF32 would round)."""
    with full_fp32():
        yield


GPU_SETUPS = [
    pytest.param("one GPU twice", id="device_ids=[0,0]",
                 marks=gpu_marks(1, "nn.DataParallel with device_ids=[0, 0]")),
    pytest.param("every GPU", id="all GPUs",
                 marks=gpu_marks(2, "nn.DataParallel across GPUs")),
]


def device_ids_for(setup: str) -> list[int]:
    return [0, 0] if setup == "one GPU twice" else list(range(cuda_device_count()))


@pytest.mark.parametrize("setup", GPU_SETUPS)
def test_real_data_parallel_splits_and_matches_one_device(setup, no_tf32):
    """Real nn.DataParallel cuts a batch of 3n+1 (n device ids) into Tensor.chunk's sizes, one
    replica per chunk on the listed device ids, gathers on output_device, and matches the CPU
    model's outputs, loss and gradients (fp32, TF32 off): device_ids [0, 0] on one GPU, every GPU
    on two or more.

    output_device is the last device id; the module's parameters stay on cuda:0."""
    device_ids = device_ids_for(setup)
    batch_size = 3 * len(device_ids) + 1  # never divisible: the last chunk is short
    sizes = chunk_sizes(batch_size, len(device_ids))
    output_device = device_ids[-1]
    model = TinyNet()
    reference = copy.deepcopy(model)  # stays on the CPU
    inputs, targets = make_batch(batch_size)

    wrapped = nn.DataParallel(model.to("cuda:0"), device_ids=device_ids,
                              output_device=output_device)
    outputs = wrapped(inputs.to("cuda:0"))
    calls = list(TinyNet.calls)
    TinyNet.calls.clear()

    # The replicas run in threads, so the record's order is not fixed: compare sorted.
    assert sorted(size for size, _ in calls) == sorted(sizes), (
        f"replicas received batches of sizes {[size for size, _ in calls]}, expected {sizes}"
    )
    used = device_ids[:len(sizes)]
    assert sorted(device.index for _, device in calls) == sorted(used), (
        f"replicas ran on {[str(d) for _, d in calls]}, expected cuda:{used}"
    )
    assert outputs.device == torch.device("cuda", output_device), (
        f"the gathered output is on {outputs.device}, expected output_device cuda:{output_device}"
    )
    loss = F.mse_loss(outputs, targets.to(outputs.device))
    loss.backward()

    reference_outputs = reference(inputs)
    reference_loss = F.mse_loss(reference_outputs, targets)
    reference_loss.backward()
    assert_close(outputs, reference_outputs, f"DataParallel{device_ids} outputs vs CPU")
    assert_close(loss, reference_loss, f"DataParallel{device_ids} loss vs CPU")
    for param in model.parameters():
        assert param.device == torch.device("cuda", 0), "the model's parameters left cuda:0"
    assert_parameters_close(model, reference, f"DataParallel{device_ids}", grads=True)


@pytest.mark.parametrize("setup", GPU_SETUPS)
def test_real_data_parallel_training_matches_one_device(setup, no_tf32):
    """Three SGD steps with momentum 0.9 through real nn.DataParallel leave, after each step, the
    parameters the same steps leave on one unwrapped GPU copy (TF32 off): device_ids [0, 0] on one
    GPU, every GPU on two or more, batches of 3n+1 for n device ids."""
    device_ids = device_ids_for(setup)
    batch_size = 3 * len(device_ids) + 1
    model = TinyNet().to("cuda:0")
    reference = copy.deepcopy(model)
    wrapped = nn.DataParallel(model, device_ids=device_ids)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(1, 4):
        inputs, targets = (t.to("cuda:0") for t in make_batch(batch_size, seed=10 + step))
        for net, opt in ((wrapped, optimizer), (reference, reference_optimizer)):
            opt.zero_grad(set_to_none=True)
            F.mse_loss(net(inputs), targets).backward()
            opt.step()
        assert_parameters_close(model, reference,
                                f"parameter after {step} SGD steps with DataParallel{device_ids}")


class CountingNet(TinyNet):
    """Counts its forwards in an attribute: the replicas count on their own copies."""

    def __init__(self):
        super().__init__()
        self.forwards = 0

    def forward(self, x):
        self.forwards += 1
        return super().forward(x)


@needs_gpus(1, "nn.DataParallel with device_ids=[0, 0]")
def test_real_data_parallel_replicates_on_every_forward():
    """Real nn.DataParallel (device_ids [0, 0]) runs 2 replicas at each of 2 forwards and the
    wrapped module's forward counter stays 0: an attribute change made in forward happens on a
    replica and is lost."""
    model = CountingNet().to("cuda:0")
    wrapped = nn.DataParallel(model, device_ids=[0, 0])
    x = torch.randn(6, 5, device="cuda:0")
    wrapped(x)
    wrapped(x)
    assert len(TinyNet.calls) == 4, f"expected 2 replicas x 2 forwards, got {TinyNet.calls}"
    assert model.forwards == 0, (
        "the wrapped module counted its own forwards; DataParallel should have run fresh "
        "replicas, whose attribute updates are lost"
    )
    model(x)
    assert model.forwards == 1


class LossInsideNet(nn.Module):
    """Returns its own mean loss, a common pattern that meets DataParallel's gather."""

    def __init__(self):
        super().__init__()
        self.net = TinyNet()

    def forward(self, x, y):
        return F.mse_loss(self.net(x), y)


@needs_gpus(1, "nn.DataParallel with device_ids=[0, 0]")
def test_real_data_parallel_returns_one_loss_per_replica(no_tf32):
    """A loss computed inside forward comes back from real nn.DataParallel (device_ids [0, 0], 7
    samples in chunks of 4 and 3) as one loss per replica: their plain mean is not the batch's loss,
    their mean weighted by chunk size is."""
    model = LossInsideNet().to("cuda:0")
    wrapped = nn.DataParallel(model, device_ids=[0, 0])
    inputs, targets = (t.to("cuda:0") for t in make_batch(7))  # chunks [4, 3]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "all input tensors were scalars; will unsqueeze"
        losses = wrapped(inputs, targets)
    assert tuple(losses.shape) == (2,), f"expected one loss per replica, got {losses.shape}"
    whole = model(inputs, targets)
    assert not torch.allclose(losses.mean(), whole), "the plain mean should be off for [4, 3]"
    weights = torch.tensor([4.0, 3.0], device=losses.device) / 7
    assert_close((losses * weights).sum(), whole, "per-replica losses weighted by chunk size")


# --------------------------------------------------------------------------------------------
# The lesson's scripts run, and print what the README says.


def script_output(name: str, *args: str) -> str:
    """What a lesson script prints (harness.launch runs it with one CPU thread and a timeout:
    these runs check what the scripts print, not their speed)."""
    return run_script(LESSONS_DIR / LESSON / name, *args, result=False).output


@pytest.mark.slow
def test_where_the_batch_goes_prints_the_split():
    """where_the_batch_goes.py --batch-size 10 prints the chunk sizes, one "in model" line per chunk
    and the gathered output (10, 2): without a GPU the pass-through call and 3 replicas by hand,
    with GPUs the real nn.DataParallel on 2 or 3 replicas."""
    gpus = cuda_device_count()
    # No GPU: 3 replicas by hand. One GPU: device_ids=[0, 0]. Several: up to 3 distinct GPUs.
    replicas = 3 if gpus == 0 else max(2, min(3, gpus))
    sizes = chunk_sizes(10, replicas)
    out = script_output("where_the_batch_goes.py", "--batch-size", "10",
                        "--replicas", str(replicas))
    assert f"a batch of 10 on {replicas} replicas: chunk sizes {sizes}" in out, out
    if gpus == 0:
        assert "nn.DataParallel is a pass-through" in out, out
        assert "in model on cpu (MainThread): input (10, 5) -> output (10, 2)" in out, out
        for i, size in enumerate(sizes):
            assert f"in model on cpu (replica {i}): input ({size}, 5) -> output ({size}, 2)" in out
    else:
        # The replicas run in threads, so their lines come in any order.
        lines = [line for line in out.splitlines() if "in model on cuda:" in line]
        seen = sorted(int(line.split("input (")[1].split(",")[0]) for line in lines)
        assert seen == sorted(sizes), out
    assert "outside: input (10, 5) -> gathered output (10, 2)" in out, out


# This lesson's train.py and lesson 00's, run with the same TRAIN_ARGS (common.py): the
# train_runs fixture (conftest.py) starts both in the background.


def both_results(train_runs):
    """The run of this lesson's train.py and of lesson 00's, each with its output and result."""
    return train_runs[LESSON].result(), train_runs[BASE_LESSON].result()


@pytest.mark.slow
@pytest.mark.skipif(
    cuda_device_count() > 0,
    reason="needs a machine without a CUDA GPU (with one, DataParallel splits the batch; "
           "test_train_on_gpus_stays_close_to_lesson_00 covers that)",
)
def test_train_without_gpus_is_lesson_00_bit_for_bit(train_runs):
    """Without a CUDA GPU, train.py says DataParallel is a pass-through, keeps device_ids [], and
    gives exactly lesson 00's losses, accuracy, samples and weights' sha256, both scripts run with
    seed 3, batch size 32, 1 epoch and 320 training windows."""
    run, base = both_results(train_runs)
    assert "nn.DataParallel is a pass-through" in run.output, (
        f"train.py should say that without a GPU nn.DataParallel is a pass-through:\n{run.output}"
    )
    assert "epoch 1/1" in run.output, run.output
    result, expected = run.data, base.data
    assert result["device"] == "cpu" and result["device_ids"] == [], (
        f"without a GPU, DataParallel keeps no device_ids: got device {result['device']!r}, "
        f"device_ids {result['device_ids']!r}"
    )
    assert (result["seed"], result["batch_size"], result["epochs"]) == (3, 32, 1), result
    # The pass-through calls the very model lesson 00 trains, on the very same batches.
    for key in ("sample_before", "train_loss", "val_loss", "val_accuracy", "sample_after",
                "params_sha256"):
        assert result[key] == expected[key], (
            f"{key}: lesson 01 gave {result[key]!r}, lesson 00 {expected[key]!r} with the same "
            f"arguments {' '.join(TRAIN_ARGS)}; without a GPU the two runs must be identical"
        )


@pytest.mark.slow
@needs_gpus(1, "nn.DataParallel in train.py; on one GPU device_ids [0, 0]")
def test_train_on_gpus_stays_close_to_lesson_00(train_runs):
    """On GPUs, train.py runs DataParallel on cuda:0 over [0, 0] (one GPU) or every GPU (several),
    and its train and validation losses stay within 0.1% (relative) of lesson 00's train.py on the
    same GPU with the same arguments.

    Not bit for bit: the replicas' chunks change the order of the float sums."""
    run, base = both_results(train_runs)
    gpus = cuda_device_count()
    device_ids = list(range(gpus)) if gpus > 1 else [0, 0]
    result, expected = run.data, base.data
    assert result["device_ids"] == device_ids, (
        f"train.py ran DataParallel over {result['device_ids']}, expected {device_ids} "
        f"on a machine with {gpus} GPU(s)"
    )
    assert result["device"] == "cuda:0", result["device"]
    assert f"DataParallel over GPUs {device_ids}" in run.output, run.output
    # Same start, same batches; the replicas' chunks only change the order of float sums, so
    # the losses are close, not equal. Measured on CPU: gradients perturbed by 1e-4 (relative)
    # every step moved them by under 1e-6; another seed (model or shuffle) by 0.3% to 2%.
    for key in ("train_loss", "val_loss"):
        assert_close(torch.tensor(result[key]), torch.tensor(expected[key]),
                     f"{key} of DataParallel{device_ids} vs lesson 00 on one GPU",
                     rtol=1e-3, atol=0.0)


def test_train_refuses_device_ids_that_are_not_numbers(train, capsys):
    """train.py parses --device-ids 0,1 as [0, 1], and refuses 0,x with exit code 2 and a usage
    error, no traceback, whose last line names --device-ids, the bad value and the expected form
    0,1."""
    assert train.parse_args(["--device-ids", "0,1"]).device_ids == [0, 1]
    with pytest.raises(SystemExit) as info:
        train.parse_args(["--device-ids", "0,x"])
    assert info.value.code == 2, f"exit code {info.value.code}, expected 2 (bad usage)"
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1] if err else ""
    assert "Traceback" not in err and "--device-ids" in last and "0,x" in last, (
        f"expected one usage error naming --device-ids and the bad value, got:\n{err}"
    )
    assert "0,1" in last, f"the error should show what is expected, like 0,1: {last}"


@pytest.mark.parametrize("argv, expected", [
    (["--device", "cpu"], "lessons/00_single_gpu/train.py --device cpu"),
    (["--device-ids", "0,5"], "this machine has GPUs 0 to 1"),
    (["--bf16"], "autocast to float16"),  # the replica threads do not inherit the dtype
    (["--compile"], "new replicas of the model every step"),
])
def test_train_refuses_what_data_parallel_cannot_do_on_a_gpu_machine(train, monkeypatch, capsys,
                                                                     argv, expected):
    """On a machine with GPUs, DataParallel takes them all: no CPU run, no GPU that is not
    there; nor bfloat16 autocast, nor --compile. Each is refused in one line before anything
    touches CUDA (imitated: 2 GPUs)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    code = train.main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, f"train.main({argv}) returned {code}, expected 2 (bad usage)"
    assert len(err.splitlines()) == 1 and "Traceback" not in err, f"one line expected:\n{err}"
    assert expected in err, f"the message should say {expected!r}: {err}"


class StopBeforeTraining(Exception):
    pass


@pytest.mark.skipif(
    cuda_device_count() > 0,
    reason="needs a machine without a CUDA GPU (with one, DataParallel takes every GPU)",
)
def test_fit_on_cpu_wraps_the_model_in_a_pass_through_data_parallel(train, monkeypatch):
    """Without a CUDA GPU, train.py's fit trains the GPT wrapped in nn.DataParallel with device_ids
    [], logs that it is a pass-through, and the wrapper's output is the model's own on a batch of 3.
    """
    trained = []

    def first_epoch(model, *args, **kwargs):  # record what fit trains, then stop
        trained.append(model)
        raise StopBeforeTraining

    monkeypatch.setattr(train, "train_one_epoch", first_epoch)
    log = []
    with pytest.raises(StopBeforeTraining):
        train.fit(torch.device("cpu"), epochs=1, log=log.append)
    step_model = trained[0]
    assert isinstance(step_model, nn.DataParallel), (
        f"fit trained a {type(step_model).__name__}; it should train the model wrapped in "
        f"nn.DataParallel"
    )
    assert isinstance(step_model.module, train.GPT), type(step_model.module)
    assert step_model.device_ids == [], (
        f"on a machine without CUDA, DataParallel keeps no device_ids; got "
        f"{step_model.device_ids}"
    )
    assert any("pass-through" in line for line in log), log
    inputs = torch.randint(0, step_model.module.config.vocab_size, (3, 8),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(step_model(inputs)[0], step_model.module(inputs)[0]), (
            "the pass-through should call the model itself on the whole batch"
        )


@pytest.mark.slow
def test_walkthrough_runs_as_a_script():
    """walkthrough.py runs as a plain script and prints the split of 10 samples on 3 GPUs, [4, 4,
    2], and that backward through hand-made replicas leaves the model's own gradients None."""
    out = script_output("walkthrough.py")
    assert "10 samples on 3 GPUs -> [4, 4, 2]" in out, out
    assert "the model's own gradients after backward: [None, None, None, None]" in out, out
