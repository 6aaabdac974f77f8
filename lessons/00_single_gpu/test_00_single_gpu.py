"""Lesson 00: the lesson's own claims (training lowers the loss, train.py's evaluate is exact,
a seed gives bitwise the same run, everything lives on the chosen device, the scripts' refusals
and runs). Each task's grader is its own file, test_00_K_*.py.

    pytest lessons/00_single_gpu               # everything
    pytest lessons/00_single_gpu -m task0_2    # one task
"""

from __future__ import annotations

import argparse
import math
import re

import pytest
import torch
import torch.nn.functional as F
from gpt import GPT, SIZES, CharDataset, GPTConfig, run, train_val_split
from gpt.run import quiet
from torch.utils.data import DataLoader, Subset

from harness.compare import assert_close
from harness.exercises import REPO_ROOT
from harness.hardware import cuda_device_count, gpu_marks, needs_gpus
from harness.launch import run_script
from lesson00.common import imitate_machine

LESSON = "00_single_gpu"
LESSON_DIR = REPO_ROOT / "lessons" / LESSON
ON_CPU_AND_GPU = ["cpu", pytest.param("cuda", marks=gpu_marks(1))]

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def one_thread():
    """train.py's default (--threads 1): the tiny model's matrices are too small to share out,
    and on a busy 2-core machine every multi-threaded op waits for the second core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data():
    """The running example's data, split the way train.fit splits it: 1010 / 112 windows."""
    dataset = CharDataset(SIZES["tiny"]["block_size"])
    train_set, val_set = train_val_split(dataset)
    return dataset, train_set, val_set


def tiny_gpt(dataset, seed: int = 0) -> GPT:
    return GPT(GPTConfig.named("tiny", vocab_size=dataset.vocab_size), seed=seed)


def all_windows(subset):
    """Every (input, target) window of ``subset`` stacked into one batch: (N, 32) each."""
    inputs, targets = zip(*(subset[i] for i in range(len(subset))), strict=True)
    return torch.stack(inputs), torch.stack(targets)


def test_training_makes_the_validation_loss_go_down(train, data, one_thread):
    """Two epochs of `train.py`'s loop on 256 training windows (tiny GPT, CPU, one thread) lower the
    training loss and take the validation loss from about that of an even guess over 61 characters
    to at least 0.5 lower, with an accuracy above always guessing the most common character."""
    dataset, train_set, val_set = data
    # 2 epochs over the first 256 training windows (32 steps, about a second), the full
    # validation set.
    train_loader, val_loader = train.make_loaders(Subset(train_set, range(256)), val_set, 16,
                                                  seed=0, device=CPU)
    model = tiny_gpt(dataset)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    loss_before, _ = run.evaluate(model, val_loader, CPU)
    train_losses = [train.train_one_epoch(model, train_loader, optimizer, CPU)
                    for _ in range(2)]
    loss_after, accuracy = run.evaluate(model, val_loader, CPU)

    # Small initial weights predict every character about equally: loss ln(vocabulary size).
    assert abs(loss_before - math.log(dataset.vocab_size)) < 0.1, (
        f"validation loss {loss_before:.4f} before training, expected about "
        f"ln({dataset.vocab_size}) = {math.log(dataset.vocab_size):.4f}"
    )
    assert train_losses[1] < train_losses[0], f"training loss went up: {train_losses}"
    assert loss_after < loss_before - 0.5, (
        f"validation loss {loss_before:.4f} -> {loss_after:.4f}: expected it at least 0.5 lower"
    )
    _, targets = all_windows(val_set)
    most_common = targets.flatten().bincount().max().item() / targets.numel()
    assert accuracy > most_common, (
        f"validation accuracy {accuracy:.1%} after 2 epochs: no better than always guessing the "
        f"most common character ({most_common:.1%})"
    )


def test_evaluate_in_train_py_is_exact_with_a_short_last_batch(train, data, one_thread):
    """`gpt.run.evaluate`, the validation every script uses, gives the loss and accuracy per
    character of one pass over all 112 windows (to 1e-5) when batches of 48 leave a last batch of
    16, not the mean of the batch means."""
    dataset, train_set, val_set = data
    # An untrained model's loss is about ln(61) at every character, whichever batch it is in,
    # and would hide a wrong average: train it a little first, with a loop of our own.
    model = tiny_gpt(dataset)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for inputs, targets in DataLoader(Subset(train_set, range(320)), batch_size=16):
        _, loss = model(inputs, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    batch_size = 48
    assert len(val_set) % batch_size != 0, "the last validation batch should be short"
    _, val_loader = train.make_loaders(val_set, val_set, batch_size, seed=0, device=CPU)
    inputs, targets = all_windows(val_set)
    with torch.no_grad():
        logits, _ = model(inputs)  # one pass over all 112 windows at once
        per_char = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        hits = (logits.argmax(dim=-1) == targets).float()
    expected_loss, expected_accuracy = per_char.mean().item(), hits.mean().item()
    batches = per_char.view(len(val_set), -1).split(batch_size)  # the loader's batches
    sizes = [len(batch) for batch in batches]
    loss_of_batch_means = sum(batch.mean().item() for batch in batches) / len(batches)
    assert abs(loss_of_batch_means - expected_loss) > 1e-3, (
        "the test's model no longer tells the mean of batch means from the exact mean"
    )

    got_loss, got_accuracy = run.evaluate(model, val_loader, CPU)

    if math.isclose(got_loss, loss_of_batch_means, rel_tol=1e-5):
        pytest.fail(
            f"gpt.run.evaluate returned loss {got_loss:.6f}, the mean of the {len(sizes)} batch "
            f"means; expected {expected_loss:.6f}, the mean over every character: batches of "
            f"{sizes} windows must weigh by their size"
        )
    assert_close(got_loss, expected_loss, "gpt.run.evaluate: loss per character over the whole "
                 f"validation set, in batches of {sizes} windows", rtol=1e-5, atol=1e-6)
    assert_close(got_accuracy, expected_accuracy, "gpt.run.evaluate: next-character accuracy over "
                 f"the whole validation set, in batches of {sizes} windows", rtol=1e-5, atol=1e-6)


def test_same_seed_gives_bitwise_identical_parameters_on_cpu(train, one_thread):
    """`train.fit` on the CPU with seed 3, twice, gives bitwise identical parameters (`torch.equal`)
    and the same result record, timings aside; seed 4 gives other parameters and another sha256
    digest (one epoch of 4 steps)."""
    # One epoch of the first 512 windows in batches of 128 (4 steps) is enough to compare; the
    # seed sets the initial weights and the shuffle order.
    quick = {"epochs": 1, "batch_size": 128, "train_windows": 512, "log": quiet}
    first, result_a = train.fit(CPU, seed=3, **quick)
    second, result_b = train.fit(CPU, seed=3, **quick)
    other, result_c = train.fit(CPU, seed=4, **quick)
    for (name, a), b in zip(first.named_parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b), (
            f"seed 3 twice gave different {name!r}: max difference {(a - b).abs().max():.3g}"
        )
    assert len(result_a["params_sha256"]) == 64
    timing = {"epoch_seconds", "samples_per_s"}
    for key in sorted(result_a.keys() - timing):
        assert result_a[key] == result_b[key], (
            f"seed 3 twice gave different {key!r}: {result_a[key]!r} and {result_b[key]!r}"
        )
    assert not all(torch.equal(a, c) for a, c in zip(first.parameters(), other.parameters(),
                                                     strict=True)), "seed 4 gave seed 3's weights"
    assert result_c["params_sha256"] != result_a["params_sha256"]


@pytest.mark.parametrize("device_name", ON_CPU_AND_GPU)
def test_model_optimizer_state_and_data_live_on_the_chosen_device(train, data, device_name,
                                                                  one_thread):
    """After a training epoch and an evaluation, the model's inputs, its parameters and AdamW's
    state tensors are all on the chosen device, and the loaders pin host memory only for CUDA."""
    device = torch.device(device_name)
    dataset, train_set, val_set = data
    train_loader, val_loader = train.make_loaders(Subset(train_set, range(64)),
                                                  Subset(val_set, range(40)), 16, seed=0,
                                                  device=device)
    pins = (train_loader.pin_memory, val_loader.pin_memory)
    assert pins == (device.type == "cuda",) * 2, (
        f"pin_memory is {pins} (train, validation) on {device}: pinned host memory is for CUDA "
        "copies only"
    )
    model = tiny_gpt(dataset).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    seen = []
    model.register_forward_pre_hook(lambda _module, args: seen.append(args[0].device))

    train.train_one_epoch(model, train_loader, optimizer, device)
    run.evaluate(model, val_loader, device)

    assert len(seen) == 4 + 3, f"{len(seen)} forward passes, expected 4 to train, 3 to evaluate"
    assert all(d.type == device.type for d in seen), (
        f"the model received inputs on {sorted(set(map(str, seen)))}, expected {device}"
    )
    for name, p in model.named_parameters():
        assert p.device.type == device.type, f"parameter {name!r} is on {p.device}"
        assert optimizer.state[p], f"AdamW has no state for {name!r}: did it step?"
        for key, state in optimizer.state[p].items():
            if torch.is_tensor(state) and state.dim() > 0:
                assert state.device.type == device.type, (
                    f"optimizer state {key!r} of {name!r} is on {state.device}"
                )


@needs_gpus(1, "bf16 autocast training on CUDA")
def test_fit_trains_on_cuda_with_bf16(train):
    """`train.fit` with bf16 autocast on CUDA trains 2 epochs: the validation loss falls, the sample
    changes, and every parameter stays fp32 on the GPU (skipped on a GPU without bfloat16)."""
    if not torch.cuda.is_bf16_supported():
        pytest.skip("needs a CUDA GPU with bfloat16 support; this one has none")
    model, result = train.fit(torch.device("cuda"), epochs=2, bf16=True, log=quiet)
    assert result["device"] == "cuda" and result["bf16"] is True
    for name, p in model.named_parameters():
        assert p.is_cuda, f"parameter {name!r} is on {p.device}"
        assert p.dtype == torch.float32, (
            f"parameter {name!r} is {p.dtype}: autocast computes in bf16, the weights stay fp32"
        )
    assert result["val_loss"][-1] < result["val_loss"][0], result["val_loss"]
    assert result["sample_after"] != result["sample_before"]


def refused(train, monkeypatch, capsys, *argv: str) -> str:
    """Run train.main(argv), expect a usage error: exit 2 and one line on stderr; return it."""
    command = "train.py " + " ".join(argv)

    def no_training(*_args, **_kwargs):
        pytest.fail(f"{command}: main went on to train; it should have refused the device")

    monkeypatch.setattr(train, "fit", no_training)
    code = train.main(list(argv))
    err = capsys.readouterr().err.strip()
    assert code == 2, f"{command}: exit code {code}, expected 2 (bad usage)"
    assert len(err.splitlines()) == 1 and "Traceback" not in err, (
        f"{command}: expected one line on stderr, got:\n{err}"
    )
    assert err.startswith("train.py: error: "), f"{command}: {err}"
    return err


def test_train_py_refuses_cuda_without_a_gpu_in_one_line(train, monkeypatch, capsys):
    """`train.py --device cuda` on an imitated machine without a GPU ends with exit code 2 before
    training, with one line on stderr, `train.py: error: ...`, that names `'cuda'` and says `use
    'cpu'`."""
    imitate_machine(monkeypatch, 0)
    err = refused(train, monkeypatch, capsys, "--device", "cuda")
    assert "'cuda'" in err and "use 'cpu'" in err, (
        f"the message should name the request and say what to do instead: {err}"
    )


@pytest.mark.parametrize(("requested", "gpus", "expected"), [
    ("cuda:5", 2, ("'cuda:5'", "2 CUDA device(s)", "cuda:0 .. cuda:1")),  # which GPUs there are
    ("gpu", 2, ("'gpu'", "'cpu'", "'cuda'")),  # not a device name: which names are
    ("meta", 0, ("'meta'", "'cpu'", "'cuda'")),  # a device torch knows, but not one to train on
])
def test_train_py_refuses_a_device_it_cannot_use_in_one_line(train, monkeypatch, capsys,
                                                            requested, gpus, expected):
    """`train.py` refuses `--device cuda:5` with 2 imitated GPUs (naming `cuda:0 .. cuda:1`), `gpu`
    and `meta` (naming `'cpu'` and `'cuda'`) the same way: exit code 2, one line on stderr, no
    training."""
    imitate_machine(monkeypatch, gpus)
    err = refused(train, monkeypatch, capsys, "--device", requested)
    missing = [part for part in expected if part not in err]
    assert not missing, f"the message should say {missing}: {err}"


@pytest.mark.slow
def test_train_script_runs_and_writes_its_result():
    """`train.py --epochs 2 --train-windows 320`, run as a script, prints both epochs and writes a
    result whose losses fall, with accuracies in [0, 1], a throughput, a sha256 digest and two
    different 60-character samples."""
    # Two quick epochs (the first 320 windows): enough to see the loss fall. run_script adds
    # --result and reads the JSON back.
    run = run_script(LESSON_DIR / "train.py", "--epochs", "2", "--train-windows", "320")
    assert "epoch 2/2" in run.output, run.output
    result = run.data
    keys = {"train_loss", "val_loss", "val_accuracy", "samples_per_s", "params_sha256",
            "sample_before", "sample_after"}
    assert keys <= result.keys(), f"the result has no {sorted(keys - result.keys())}"
    assert result["device"] == ("cuda" if cuda_device_count() else "cpu")
    assert len(result["train_loss"]) == len(result["val_loss"]) == len(result["val_accuracy"]) == 2
    assert result["train_loss"][1] < result["train_loss"][0], result["train_loss"]
    assert result["val_loss"][1] < result["val_loss"][0], result["val_loss"]
    assert all(0.0 <= a <= 1.0 for a in result["val_accuracy"]), result["val_accuracy"]
    assert result["samples_per_s"] > 0
    assert re.fullmatch(r"[0-9a-f]{64}", result["params_sha256"]), result["params_sha256"]
    assert len(result["sample_before"]) == len(result["sample_after"]) == 60
    assert result["sample_after"] != result["sample_before"], (
        "training did not change what the model writes"
    )


def test_a_shorter_sample_is_the_start_of_a_longer_one():
    """A sample of 1, 8 or 59 characters is the start of the 60-character one, and 0 gives an empty
    one: so a quick run may pass `--sample-length 8` (or 0) and still be compared with a full run.

    Every character is drawn from the same generator, one draw each, in order. The test also checks
    that 60 is the default and that a negative length is refused."""
    dataset = CharDataset(SIZES["tiny"]["block_size"])
    model = GPT(GPTConfig.named("tiny", vocab_size=dataset.vocab_size), seed=0)
    full = run.sample(model, dataset, "cpu", 60)
    assert len(full) == 60, full
    for length in (1, 8, 59):
        assert run.sample(model, dataset, "cpu", length) == full[:length], length
    assert run.sample(model, dataset, "cpu", 0) == ""
    args = run.add_common_arguments(argparse.ArgumentParser()).parse_args([])
    assert args.sample_length == 60
    with pytest.raises(SystemExit):
        run.add_common_arguments(argparse.ArgumentParser()).parse_args(["--sample-length", "-1"])


@pytest.mark.slow
@pytest.mark.parametrize("device_name", ON_CPU_AND_GPU)
def test_fast_one_device_prints_its_ladder(device_name):
    """`fast_one_device.py` on a small MLP with `--no-compile` prints ms/step, samples/s and TFLOP/s
    for fp32, bf16 autocast and the doubled batch, and says the compiled rungs were skipped; on the
    CPU, that TF32 does not apply; on CUDA, a TF32 rung and the % of bf16 peak."""
    out = run_script(LESSON_DIR / "fast_one_device.py", "--device", device_name,
                     "--width", "32", "--blocks", "1", "--batch-size", "64", "--steps", "2",
                     "--warmup", "1", "--no-compile", result=False).output
    for expected in ("ms/step", "samples/s", "TFLOP/s", "fp32", "bf16 autocast",
                     "bf16 autocast, batch x2", "skipped (--no-compile)"):
        assert expected in out, f"expected {expected!r} in the output:\n{out}"
    if device_name == "cpu":
        assert "tf32: does not apply on CPU" in out, out
    else:
        assert "% of bf16 peak" in out and "\ntf32 " in out, out
