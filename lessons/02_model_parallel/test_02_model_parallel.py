"""Lesson 02's own checks: what the README claims, on the GPipe simulation and on the lesson's
two scripts (train.py, pipeline_sweep.py), and the scripts' runs. Each task's grader is its own
file beside this one, test_02_K_<topic>.py.

    pytest lessons/02_model_parallel               # everything
    pytest lessons/02_model_parallel -m task2_2    # one task
    pytest lessons/02_model_parallel -m gpu        # only the checks on CUDA devices

Without a GPU, every split runs on ``cpu``/``cpu`` (the numbers) and on ``cpu``/``meta`` (where
things live); the ``cuda:0``/``cpu`` and ``cuda:0``/``cuda:1`` checks skip with the hardware they
need.
"""

from __future__ import annotations

import copy
import math
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from gpt import GPT, SIZES, CharDataset, GPTConfig, parameter_digest, run, train_val_split
from torch import nn
from torch.utils.data import Subset

from harness.compare import assert_close, assert_parameters_close
from harness.exercises import LESSONS_DIR, load_lesson_module
from harness.hardware import cuda_device_count
from lesson02.common import (
    DEVICE_PAIRS,
    LESSON,
    META,
    assert_pipelined_training_matches,
    simulate_gpipe,
)


@pytest.fixture(scope="module")
def train():
    return load_lesson_module(LESSON, "train")


@pytest.fixture(scope="module")
def sweep():
    return load_lesson_module(LESSON, "pipeline_sweep")


# --------------------------------------------------------------------------------------------
# task2_2's training check (assert_pipelined_training_matches, used by
# test_02_2_pipelined_step.py) tells a wrong micro-batch weighting from the right one


def naive_pipelined_step(model, inputs, targets, loss_fn, m):
    """The common mistake: every micro-batch's mean loss weighted by 1 / m."""
    total = 0.0
    for x, y in zip(inputs.tensor_split(m), targets.tensor_split(m), strict=True):
        loss = loss_fn(model(x), y) / m
        loss.backward()
        total += loss.item()
    return total


def test_the_training_check_catches_a_naive_one_over_m_scaling():
    """task2_2's training check passes a step that weights each micro-batch's mean loss by 1/m on 8
    samples in 4 equal micro-batches, and fails it after the first SGD step on 10 samples in 4 (3,
    3, 2, 2)."""
    # With equal micro-batches, 1/m *is* size/B: the naive scaling passes...
    assert_pipelined_training_matches(naive_pipelined_step, 8, 4)
    # ...and with unequal ones it must be caught, or the check above proves nothing.
    with pytest.raises(AssertionError, match="after 1 SGD steps"):
        assert_pipelined_training_matches(naive_pipelined_step, 10, 4)


# --------------------------------------------------------------------------------------------
# The lesson's claims, checked on its own scripts


def test_the_naive_split_keeps_one_device_busy_at_a_time():
    """With one micro-batch, the simulated GPipe schedule keeps exactly one of p stages busy at
    every time step, a utilisation of 1/p, for p from 1 to 8."""
    for p in range(1, 9):
        idle, grid = simulate_gpipe(p, 1)
        assert math.isclose(1 - idle, 1 / p), f"{p} stages, 1 micro-batch: utilisation {1 - idle}"
        busy_per_step = [sum(grid[s][t] is not None for s in range(p)) for t in range(2 * p)]
        assert busy_per_step == [1] * (2 * p), busy_per_step


def test_the_scripts_bubble_fraction_is_the_simulated_one(sweep):
    """pipeline_sweep.py's bubble_fraction is the simulated schedule's idle share, and its
    ideal_speedup the simulated utilisation over that of one micro-batch, for 1 to 6 stages and 1 to
    12 micro-batches."""
    for p in range(1, 7):
        for m in range(1, 13):
            assert math.isclose(sweep.bubble_fraction(p, m), simulate_gpipe(p, m)[0])
            assert math.isclose(sweep.ideal_speedup(p, m),
                                (1 - simulate_gpipe(p, m)[0]) / (1 - simulate_gpipe(p, 1)[0]))


def test_readme_bubble_table_matches_the_formula():
    """Every cell of the README's bubble table is (p - 1) / (m + p - 1) for its row's p and column's
    m, rounded to a whole percent."""
    readme = (LESSONS_DIR / LESSON / "README.md").read_text()
    rows = re.findall(r"^\| p = (\d+) \|(.+)\|$", readme, flags=re.MULTILINE)
    header = re.search(r"^\| stages \\ micro-batches \|(.+)\|$", readme, flags=re.MULTILINE)
    assert rows and header, "the README's bubble table is missing"
    ms = [int(cell.strip().removeprefix("m = ")) for cell in header.group(1).split("|")]
    for p, cells in rows:
        for m, cell in zip(ms, cells.split("|"), strict=True):
            expected = (int(p) - 1) / (m + int(p) - 1)
            assert cell.strip() == f"{expected:.0%}", f"p={p}, m={m}: {cell} vs {expected:.0%}"


# train.py: lesson 00's GPT training with the blocks split across two devices


@pytest.fixture(scope="module")
def gpt_data():
    """The running example's windows, cut down: 40 to train on (a few steps), 24 to evaluate."""
    dataset = CharDataset(SIZES["tiny"]["block_size"])
    train_set, val_set = train_val_split(dataset)
    return dataset, Subset(train_set, range(40)), Subset(val_set, range(24))


@pytest.fixture
def one_thread():
    """One CPU thread, as the script runs: the tiny model's matrices are too small to share."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make_gpt(vocab_size: int, **overrides) -> GPT:
    """The script's model, built on the CPU from seed 0: the same weights every time."""
    return GPT(GPTConfig.named("tiny", vocab_size=vocab_size, **overrides), seed=0)


class Crossed(Exception):
    """Raised to end a forward once the activations have crossed to the second device."""


def stop():
    raise Crossed


@pytest.mark.parametrize("n_layer", [2, 4, 6])
def test_train_py_split_across_puts_each_half_on_its_device(train, gpt_data, n_layer):
    """train.py's split_across, on cpu/meta for GPTs of 2, 4 and 6 blocks, puts the embeddings and
    the first half of the blocks on the first device and every other parameter on the second; each
    block up to the first of the second half gets its input on its own device, still requiring grad.
    """
    dataset = gpt_data[0]
    model = make_gpt(dataset.vocab_size, n_layer=n_layer)
    assert train.split_across(model, (torch.device("cpu"), META)) is model, (
        "split_across should move the model's parts in place and return the model")
    half = n_layer // 2
    first = ("tok_emb.", "pos_emb.", *(f"blocks.{i}." for i in range(half)))
    where = {name: p.device for name, p in model.named_parameters()}
    for name, device in where.items():
        expected = torch.device("cpu") if name.startswith(first) else META
        assert device == expected, (
            f"{n_layer} blocks split across cpu and meta: {name!r} is on {device}, expected "
            f"{expected} (embeddings and blocks 0-{half - 1} first, the rest with ln_f and "
            f"lm_head second)\n{where}")

    # Where each block receives its input, up to the first block on meta: the meta device shows
    # that the activations arrive there, and stopping then skips computing on meta (its
    # LayerNorm alone takes seconds to set up).
    received = []
    for k, block in enumerate(model.blocks[:half + 1]):  # after split_across's own hook
        block.register_forward_pre_hook(
            lambda _module, args, k=k: received.append((k, args[0].device, args[0].requires_grad)))
    model.blocks[half].register_forward_pre_hook(lambda _module, _args: stop())
    idx = torch.zeros(2, 8, dtype=torch.long)  # token ids on the CPU, as a batch arrives
    with pytest.raises(Crossed):
        model(idx)
    expected = [(k, torch.device("cpu"), True) for k in range(half)] + [(half, META, True)]
    assert received == expected, (
        f"(block, device of its input, requires_grad) in one forward: {received}, expected "
        f"{expected}. Before block {half}, move the activations to the second device with "
        "x.to(device), which autograd records (never .detach() them)")


def reference_epoch(model, batches, optimizer) -> float:
    """Lesson 00's training step, written out: the whole model and every batch on the CPU."""
    loss_sum, seen = 0.0, 0
    for inputs, targets in batches:
        logits, _ = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_sum, seen = loss_sum + loss.item() * len(inputs), seen + len(inputs)
    return loss_sum / seen


# (micro-batches, batch size): 40 windows are batches of 16, 16, 8 or four of 10. torch.chunk
# cuts 10 into 4, 4, 2 (M = 3) and 3, 3, 3, 1 (M = 4): pieces of unequal size.
MICRO_BATCH_CASES = [pytest.param(1, 16, id="m1-batch16"), pytest.param(2, 16, id="m2-batch16"),
                     pytest.param(3, 10, id="m3-batch10"), pytest.param(4, 10, id="m4-batch10")]


@pytest.mark.parametrize("devices", DEVICE_PAIRS)
@pytest.mark.parametrize(("micro_batches", "batch_size"), MICRO_BATCH_CASES)
def test_train_py_split_training_equals_one_device(train, gpt_data, devices, micro_batches,
                                                   batch_size, no_tf32, one_thread):
    """Two epochs of train.py's train_one_epoch on the split GPT give one CPU's parameters and mean
    losses (SGD, momentum 0.9) with 1, 2, 3 and 4 micro-batches, 3 and 4 of unequal size: bit for
    bit on cpu/cpu with 1, to fp32 tolerance otherwise; also on cuda:0/cpu and cuda:0/cuda:1."""
    dataset, train_set, val_set = gpt_data
    devices = tuple(map(torch.device, devices))
    model = train.split_across(make_gpt(dataset.vocab_size), devices)
    reference = make_gpt(dataset.vocab_size)  # one device: the CPU
    # SGD with momentum: the update is linear in the gradient, so any wrong weighting shows.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    loader, _ = train.make_loaders(train_set, val_set, batch_size, seed=0, device=devices[0])
    what = (f"{devices[0]} -> {devices[1]}, {micro_batches} micro-batch(es) of batches of "
            f"{batch_size}")
    hint = ("" if micro_batches == 1 else "\nEach piece's mean loss must weigh len(x) / "
            "len(inputs): 1 / M is right only when M divides the batch")
    for epoch in (1, 2):
        batches = list(loader)  # the same shuffled order for both
        got = train.train_one_epoch(model, batches, optimizer, devices,
                                    micro_batches=micro_batches)
        expected = reference_epoch(reference, batches, reference_optimizer)
        try:
            assert_parameters_close(model, reference, f"after epoch {epoch} ({len(batches)} "
                                    f"SGD steps): {what}: parameter")
            assert_close(got, expected, f"epoch {epoch}: {what}: mean training loss",
                         rtol=1e-5, atol=1e-6)
        except AssertionError as err:
            raise AssertionError(f"{err}{hint}") from None
    if micro_batches == 1 and devices[0] == devices[1] == torch.device("cpu"):
        # The same operations in the same order: not close, identical, as lesson 00's run.
        assert parameter_digest(model) == parameter_digest(reference), (
            f"{what}: the parameters are close to one device's but not bit for bit the same")


@pytest.mark.parametrize("devices", DEVICE_PAIRS)
def test_train_py_evaluates_a_split_model_like_one_device(train, gpt_data, devices, no_tf32,
                                                          one_thread):
    """The course's evaluate, on train.py's split GPT in batches of 10, 10 and 4, gives one device's
    validation loss and accuracy (to 1e-5, relative): on cpu/cpu, on cuda:0/cpu with a GPU, on
    cuda:0/cuda:1 with two."""
    dataset, train_set, val_set = gpt_data
    devices = tuple(map(torch.device, devices))
    model = train.split_across(make_gpt(dataset.vocab_size), devices)
    reference = make_gpt(dataset.vocab_size)
    _, val_loader = train.make_loaders(train_set, val_set, 10, seed=0, device=devices[0])
    # gpt.run's evaluate: the batch goes in on the first device, the targets meet the logits on
    # the second.
    loss, accuracy = run.evaluate(model, val_loader, devices[0])  # batches of 10, 10, 4
    inputs, targets = (torch.stack(t) for t in zip(*val_set, strict=True))
    with torch.no_grad():
        logits, expected_loss = reference(inputs, targets)
    split = f"{devices[0]} -> {devices[1]}"
    assert_close(loss, expected_loss.item(), f"{split}: validation loss", rtol=1e-5, atol=1e-6)
    assert_close(accuracy, (logits.argmax(-1) == targets).float().mean().item(),
                 f"{split}: validation accuracy", rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("gpus", "expected"), [(0, ["cpu", "cpu"]), (1, ["cuda:0", "cpu"]),
                                                (2, ["cuda:0", "cuda:1"]),
                                                (4, ["cuda:0", "cuda:1"])])
def test_the_scripts_pick_the_best_device_pair(train, sweep, monkeypatch, gpus, expected):
    """train.py and pipeline_sweep.py pick, as a tuple of torch.device, cpu/cpu without a GPU,
    cuda:0/cpu with one, cuda:0/cuda:1 with two or four (GPU counts imitated)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    for script in (train, sweep):
        pair = script.pick_device_pair()
        assert isinstance(pair, tuple) and all(isinstance(d, torch.device) for d in pair), (
            f"{script.__name__}.pick_device_pair() returned {pair!r}, expected a tuple of two "
            "torch.device")
        assert pair == tuple(torch.device(d) for d in expected), (script.__name__, pair)


@pytest.mark.parametrize("devices", ["cpu", "cpu,cpu,cpu"])
def test_train_py_refuses_anything_but_two_devices_in_one_line(train, capsys, devices):
    """train.py refuses --devices cpu and --devices cpu,cpu,cpu with exit code 2 and one line, no
    traceback, that says it expected two, like cuda:0,cuda:1."""
    code = train.main(["--devices", devices])
    err = capsys.readouterr().err.strip()
    assert code == 2, f"--devices {devices}: exit code {code}, expected 2 (bad usage)"
    assert len(err.splitlines()) == 1 and "Traceback" not in err, f"expected one line:\n{err}"
    assert "expected two" in err and "cuda:0,cuda:1" in err, err


def test_the_sweeps_gpipe_step_trains_like_the_full_batch(sweep):
    """pipeline_sweep.py's gpipe_step on 10 samples in 4 micro-batches (3, 3, 2, 2) gives the full
    batch's loss and, after each of 3 SGD steps (momentum 0.9), its parameters, on cpu/cpu."""
    devices = [torch.device("cpu")] * 2
    stages = sweep.build_stages(8, 4, devices)
    reference = nn.Sequential(*copy.deepcopy(stages))
    optimizer = torch.optim.SGD([p for s in stages for p in s.parameters()], lr=0.1,
                                momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(3)
    for step in (1, 2, 3):
        inputs, targets = torch.randn(10, 8, generator=g), torch.randn(10, 8, generator=g)
        optimizer.zero_grad()
        loss = sweep.gpipe_step(stages, devices, inputs, targets, 4)  # 3, 3, 2, 2
        optimizer.step()
        reference_optimizer.zero_grad()
        expected = F.mse_loss(reference(inputs), targets)
        expected.backward()
        reference_optimizer.step()
        assert_close(loss, expected.detach(), f"gpipe_step loss at step {step}")
        got = {f"{k}.{n}": p for k, s in enumerate(stages) for n, p in s.named_parameters()}
        assert_parameters_close(got, dict(reference.named_parameters()),
                                f"after {step} SGD steps, gpipe_step with 4 micro-batches")


def test_the_sweeps_gpipe_step_follows_the_clock_schedule(sweep):
    """pipeline_sweep.py's gpipe_step runs 3 stages on 3 micro-batches in GPipe's clock order: at
    clock t, stage s runs micro-batch t - s."""
    devices = [torch.device("cpu")] * 3
    stages = sweep.build_stages(8, 3, devices)
    order = []
    for k, stage in enumerate(stages):
        stage.register_forward_pre_hook(lambda _m, _args, k=k: order.append(k))
    inputs = torch.randn(6, 8)
    sweep.gpipe_step(stages, devices, inputs, torch.randn(6, 8), 3)
    # Clock t runs stage s on micro-batch t - s: (0), (1, 0), (2, 1, 0) by micro-batch...
    expected = [s for t in range(3 + 3 - 1) for s in range(3) if 0 <= t - s < 3]
    assert order == expected, f"stages ran in the order {order}, expected {expected}"


def test_batchnorm_breaks_the_micro_batch_equivalence(sweep):
    """Micro-batches change what BatchNorm computes in training mode, not what LayerNorm does:
    pipeline_sweep.py's gpipe_step on 8 samples gives another loss in 4 micro-batches than in 1
    with BatchNorm, the same loss with LayerNorm.

    The README's caveat: BatchNorm normalises each micro-batch by its own statistics."""
    devices = [torch.device("cpu")] * 2
    g = torch.Generator().manual_seed(4)
    inputs, targets = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
    for norm, equal in ((nn.BatchNorm1d, False), (nn.LayerNorm, True)):
        torch.manual_seed(0)
        stages = [nn.Sequential(nn.Linear(6, 6), norm(6)), nn.Sequential(nn.Linear(6, 6))]
        whole = copy.deepcopy(stages)
        loss_micro = sweep.gpipe_step(stages, devices, inputs, targets, 4)
        loss_whole = sweep.gpipe_step(whole, devices, inputs, targets, 1)
        assert torch.allclose(loss_micro, loss_whole) == equal, (norm.__name__, loss_micro,
                                                                 loss_whole)


# --------------------------------------------------------------------------------------------
# The scripts run, and print what the README says

# Both scripts are started by conftest.py's script_runs, before the lesson's first test.


def script_output(script_runs, name: str) -> tuple[str, dict]:
    """The output of ``name`` (started by the fixture) and the JSON it wrote to --result."""
    run = script_runs[name].result()
    return run.output, run.data


def expected_pair() -> list[str]:
    gpus = cuda_device_count()
    return ["cuda:0", "cuda:1"] if gpus >= 2 else ["cuda:0", "cpu"] if gpus else ["cpu", "cpu"]


@pytest.mark.slow
def test_train_py_trains_the_split_gpt_and_prints_where_it_is(script_runs):
    """train.py --micro-batches 2 (1 epoch, 480 windows) prints and records where the model is on
    this machine's best pair, "(blocks 0-1; the rest on ...)", and its losses fall: validation below
    training below ln(vocabulary size) - 0.5."""
    out, data = script_output(script_runs, "train.py")
    first, second = expected_pair()
    assert re.search(rf"^device {first} \(blocks 0-1; the rest on {second}, 2 micro-batch\(es\)\)",
                     out, flags=re.MULTILINE), out
    assert "epoch 1/1" in out and "parameters sha256" in out, out
    assert data["devices"] == [first, second], data["devices"]
    assert data["micro_batches"] == 2
    # From the untrained model's loss, about ln(vocab size), down over the epoch and below it.
    start = math.log(CharDataset(SIZES["tiny"]["block_size"]).vocab_size)
    [train_loss], [val_loss] = data["train_loss"], data["val_loss"]
    assert val_loss < train_loss < start - 0.5, (
        f"untrained ~{start:.3f} (ln of the vocabulary), mean training loss {train_loss:.4f}, "
        f"validation loss after the epoch {val_loss:.4f}: expected each below the one before")
    assert re.fullmatch(r"[0-9a-f]{64}", data["params_sha256"]), data["params_sha256"]
    assert data["params_sha256"][:16] in out, "the printed digest is the one in the result"


@pytest.mark.slow
def test_pipeline_sweep_prints_a_row_per_micro_batch_count(script_runs):
    """pipeline_sweep.py --micro-batches 1,2,4,64 on a batch of 30 prints rows for m = 1, 2 and 4
    only, bubbles 50.0%, 33.3% and 20.0%, gradients within 1e-5 of m = 1's; on cpu/cpu it says that
    one device runs the stages one after another."""
    out, data = script_output(script_runs, "pipeline_sweep.py")
    first, second = expected_pair()
    assert f"2 stages on {first} -> {second}" in out, out
    rows = data["rows"]
    assert [row["micro_batches"] for row in rows] == [1, 2, 4], "m=64 > batch 30 is dropped"
    assert [f"{row['bubble']:.1%}" for row in rows] == ["50.0%", "33.3%", "20.0%"]
    for row in rows:
        assert row["step_ms"] > 0
        assert row["grad_max_diff"] < 1e-5, f"m={row['micro_batches']}: gradients differ"
        assert re.search(rf"^ +{row['micro_batches']} +{row['micro_batch_size']} +[\d.]+ ", out,
                         flags=re.MULTILINE), out
    if first == second == "cpu":
        assert "One device executes the stages one after another" in out, out
        assert "CUDA kernels are queued asynchronously on each device" in out, out


def test_pipeline_sweep_plot_needs_matplotlib_only_when_asked(sweep, tmp_path, monkeypatch,
                                                              capsys):
    """pipeline_sweep.py --plot writes a plot when matplotlib is installed; without it (imitated),
    it exits with code 2, saying "--plot needs matplotlib" and "pip install matplotlib", and prints
    nothing else."""
    path = tmp_path / "sweep.png"
    args = ["--devices", "cpu,cpu", "--width", "8", "--blocks", "2", "--batch-size", "4",
            "--micro-batches", "1,2", "--steps", "1", "--plot", str(path)]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        available = False
    else:
        available = True
    if available:
        assert sweep.main(args) == 0
        assert path.stat().st_size > 0, "no plot was written"
    # Without matplotlib (imitated when it is installed), --plot is refused in one line, at once.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    capsys.readouterr()
    assert sweep.main(args) == 2
    captured = capsys.readouterr()
    assert "--plot needs matplotlib" in captured.err and "pip install matplotlib" in captured.err
    assert captured.out == "", "the sweep should not run when the plot cannot be drawn"
