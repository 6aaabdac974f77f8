"""Lesson 00: grades the exercises (task0_1 .. task0_4) and checks the lesson's own claims.

    pytest lessons/00_single_gpu               # everything
    pytest lessons/00_single_gpu -m task0_2    # one task
"""

from __future__ import annotations

import collections
import copy
import math
import re

import pytest
import torch
import torch.nn.functional as F
from gpt import GPT, SIZES, CharDataset, GPTConfig, run, train_val_split
from gpt.run import quiet
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from harness.compare import assert_close, assert_parameters_close
from harness.exercises import REPO_ROOT, load_exercise, load_lesson_module
from harness.hardware import cuda_device_count, gpu_marks, needs_gpus
from harness.launch import run_script

LESSON = "00_single_gpu"
LESSON_DIR = REPO_ROOT / "lessons" / LESSON
ON_CPU_AND_GPU = ["cpu", pytest.param("cuda", marks=gpu_marks(1))]

# Each task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task0_1": {
        "None or 'auto': cuda if torch.cuda.is_available(), else cpu": [
            "test_choose_device_auto_takes_a_gpu_only_when_there_is_one"],
        "'cpu': the CPU": ["test_choose_device_honours_the_request"],
        "'cuda' or 'cuda:N': that device": ["test_choose_device_honours_the_request"],
        "raise ValueError when CUDA is not available, with a message that names 'cpu'": [
            "test_choose_device_refuses_cuda_without_a_gpu"],
        "raise ValueError when N is not below torch.cuda.device_count()": [
            "test_choose_device_refuses_what_it_cannot_give"],
        "the out-of-range message gives the valid range, cuda:0 to cuda:<count - 1>": [
            "test_choose_device_names_the_valid_range_when_the_index_is_too_high"],
        "anything else ('gpu', 'tpu', '', 'cuda:x'): ValueError": [
            "test_choose_device_refuses_what_it_cannot_give"],
        "ask torch.cuda.is_available() / device_count() when called": [
            "test_choose_device_auto_takes_a_gpu_only_when_there_is_one",
            "test_choose_device_refuses_cuda_without_a_gpu"],
    },
    "task0_2": {
        "every tensor t is replaced by t.to(device, non_blocking=non_blocking)": [
            "test_to_device_moves_a_single_tensor", "test_to_device_passes_non_blocking_on"],
        "non_blocking defaults to False": ["test_to_device_passes_non_blocking_on"],
        "the same structure with the same container types (a tuple stays a tuple)": [
            "test_to_device_keeps_an_inputs_targets_tuple",
            "test_to_device_keeps_a_nested_structure", "test_to_device_keeps_a_namedtuple"],
        "a dict keeps all its keys in order": ["test_to_device_keeps_a_nested_structure"],
        "any other leaf is returned untouched, as the same object": [
            "test_to_device_keeps_a_nested_structure"],
    },
    "task0_3": {
        "clear the gradients left by earlier steps": [
            "test_train_step_matches_a_reference_loop_over_two_steps"],
        "compute loss_fn(model(inputs), targets), back-propagate, step the optimizer": [
            "test_train_step_matches_a_reference_loop_over_two_steps"],
        "return the loss (computed before the step) as a Python float": [
            "test_train_step_matches_a_reference_loop_over_two_steps"],
    },
    "task0_4": {
        "the exact mean loss per sample: weigh each batch by its number of samples": [
            "test_evaluate_is_the_exact_mean_over_all_samples"],
        "run the model in eval mode": [
            "test_evaluate_uses_eval_mode_no_grad_and_restores_the_mode"],
        "with gradients off (torch.no_grad())": [
            "test_evaluate_uses_eval_mode_no_grad_and_restores_the_mode"],
        "leave it in the training/eval mode it was in before": [
            "test_evaluate_uses_eval_mode_no_grad_and_restores_the_mode"],
        "return a Python float": ["test_evaluate_is_the_exact_mean_over_all_samples"],
    },
}


@pytest.fixture(scope="module")
def ex():
    return load_exercise(LESSON)


@pytest.fixture(scope="module")
def train():
    return load_lesson_module(LESSON, "train")


# ---------------------------------------------------------------- task0_1: choose_device

def imitate_machine(monkeypatch, gpus: int) -> None:
    """Make torch.cuda report ``gpus`` devices, so every branch can be graded on a CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)


def describe(requested, gpus: int) -> str:
    return f"choose_device({requested!r}) on a machine with {gpus} GPU(s)"


def assert_device(got, expected_type: str, expected_index, what: str) -> None:
    assert isinstance(got, torch.device), (
        f"{what} returned {type(got).__name__} {got!r}, expected a torch.device"
    )
    if expected_index is None:  # plain "cuda" may come back as cuda or cuda:0
        indices = (None, 0) if expected_type == "cuda" else (None,)
    else:
        indices = (expected_index,)
    assert got.type == expected_type and got.index in indices, (
        f"{what} returned {got}, expected {torch.device(expected_type, expected_index)}"
    )


def assert_refused(ex, requested, gpus: int, why: str) -> str:
    what = describe(requested, gpus)
    try:
        got = ex.choose_device(requested)
    except ValueError as err:
        assert str(err).strip(), f"{what} raised ValueError with an empty message; say why"
        return str(err)
    except NotImplementedError:
        raise
    except Exception as err:
        pytest.fail(f"{what} raised {type(err).__name__}: {err}; expected ValueError ({why})")
    pytest.fail(f"{what} returned {got!r}; expected ValueError ({why})")


@pytest.mark.task0_1
@pytest.mark.parametrize("gpus", [0, 2])
@pytest.mark.parametrize("requested", [None, "auto"])
def test_choose_device_auto_takes_a_gpu_only_when_there_is_one(ex, monkeypatch, requested, gpus):
    imitate_machine(monkeypatch, gpus)
    got = ex.choose_device(requested)
    assert_device(got, "cuda" if gpus else "cpu", None, describe(requested, gpus))


@pytest.mark.task0_1
@pytest.mark.parametrize(("requested", "gpus", "device_type", "index"), [
    ("cpu", 0, "cpu", None),
    ("cpu", 2, "cpu", None),  # a GPU being there must not override an explicit request
    ("cuda", 2, "cuda", None),
    ("cuda:0", 2, "cuda", 0),
    ("cuda:1", 2, "cuda", 1),
])
def test_choose_device_honours_the_request(ex, monkeypatch, requested, gpus, device_type, index):
    imitate_machine(monkeypatch, gpus)
    got = ex.choose_device(requested)
    assert_device(got, device_type, index, describe(requested, gpus))


@pytest.mark.task0_1
@pytest.mark.parametrize("requested", ["cuda", "cuda:0"])
def test_choose_device_refuses_cuda_without_a_gpu(ex, monkeypatch, requested):
    imitate_machine(monkeypatch, 0)
    message = assert_refused(ex, requested, 0, "CUDA is not available")
    assert "cpu" in message.lower(), (
        f"{describe(requested, 0)} raised ValueError({message!r}); the message should tell the "
        "user the way out, for example: use 'cpu' (or 'auto')"
    )


@pytest.mark.task0_1
@pytest.mark.parametrize(("requested", "gpus", "why"), [
    ("cuda:2", 2, "there is no third GPU"),
    ("cuda:1", 1, "there is no second GPU"),
    ("gpu", 2, "not a device name torch knows"),
    ("tpu", 0, "not a device this function supports"),
    ("", 0, "an empty request"),
    ("cuda:x", 2, "not a device index"),
])
def test_choose_device_refuses_what_it_cannot_give(ex, monkeypatch, requested, gpus, why):
    imitate_machine(monkeypatch, gpus)
    assert_refused(ex, requested, gpus, why)



@pytest.mark.task0_1
@pytest.mark.parametrize(("requested", "gpus"), [("cuda:2", 2), ("cuda:5", 2), ("cuda:1", 1)])
def test_choose_device_names_the_valid_range_when_the_index_is_too_high(ex, monkeypatch,
                                                                        requested, gpus):
    imitate_machine(monkeypatch, gpus)
    message = assert_refused(ex, requested, gpus, f"there are only {gpus} GPU(s)")
    last = f"cuda:{gpus - 1}"
    asked = int(requested.partition(":")[2])
    named = {int(index) for index in re.findall(r"cuda:(\d+)", message)}
    beyond = sorted(named - {asked} - set(range(gpus)))
    assert last in message and not beyond, (
        f"{describe(requested, gpus)} raised ValueError({message!r}); the message should give the "
        f"valid range, cuda:0 to {last} (the last valid index is the number of GPUs minus one)"
        + (f", but it names {', '.join(f'cuda:{i}' for i in beyond)}, which this machine does "
           "not have" if beyond else "")
    )

# ---------------------------------------------------------------- task0_2: to_device

META = torch.device("meta")  # a device every machine has: tensors moved there are easy to spot


def nested_batch():
    return {
        "image": torch.randn(2, 3),
        "target": (torch.tensor([1, 2]), "cat", 7),
        "extra": [torch.zeros(1), {"mask": torch.ones(2, dtype=torch.bool), "note": None}],
    }


def assert_moved(got, original, where: str = "batch") -> None:
    """``got`` has the structure and container types of ``original``; tensors are on meta."""
    if isinstance(original, torch.Tensor):
        assert isinstance(got, torch.Tensor), (
            f"{where}: expected a tensor, got {type(got).__name__}"
        )
        assert got.device.type == "meta", (
            f"{where}: tensor is on {got.device}, expected it moved to {META}"
        )
        assert got.shape == original.shape and got.dtype == original.dtype, (
            f"{where}: got shape {tuple(got.shape)} {got.dtype}, expected "
            f"{tuple(original.shape)} {original.dtype} (move it, do not change it)"
        )
    elif isinstance(original, (dict, list, tuple)):
        assert type(got) is type(original), (
            f"{where}: got a {type(got).__name__}, expected a {type(original).__name__} "
            "(keep each container's type)"
        )
        if isinstance(original, dict):
            assert list(got) == list(original), (
                f"{where}: keys {list(got)}, expected {list(original)} (all of them, in order)"
            )
            for key in original:
                assert_moved(got[key], original[key], f"{where}[{key!r}]")
        else:
            assert len(got) == len(original), (
                f"{where}: {len(got)} items, expected {len(original)}"
            )
            for i, (item, expected) in enumerate(zip(got, original, strict=True)):
                assert_moved(item, expected, f"{where}[{i}]")
    else:
        assert got is original, (
            f"{where}: got {got!r}, expected the same object {original!r} "
            "(leave leaves that are not tensors untouched)"
        )


@pytest.mark.task0_2
def test_to_device_moves_a_single_tensor(ex):
    tensor = torch.arange(6.0).reshape(2, 3)
    assert_moved(ex.to_device(tensor, META), tensor, "to_device(tensor)")


@pytest.mark.task0_2
def test_to_device_keeps_an_inputs_targets_tuple(ex):
    batch = (torch.randn(4, 3), torch.tensor([0, 1, 1, 0]))
    assert_moved(ex.to_device(batch, META), batch)


@pytest.mark.task0_2
def test_to_device_keeps_a_nested_structure(ex):
    batch = nested_batch()
    assert_moved(ex.to_device(batch, META), batch)


@pytest.mark.task0_2
def test_to_device_keeps_a_namedtuple(ex):
    Batch = collections.namedtuple("Batch", ["inputs", "targets"])
    batch = Batch(torch.randn(4, 3), torch.tensor([0, 1, 1, 0]))
    try:
        got = ex.to_device(batch, META)
    except TypeError as err:
        pytest.fail(f"to_device(namedtuple) raised TypeError: {err}; a namedtuple is built from "
                    "its fields as separate arguments: type(batch)(*moved), not type(batch)(moved)")
    assert_moved(got, batch, "to_device(Batch(inputs, targets))")


@pytest.mark.task0_2
@pytest.mark.parametrize("non_blocking", [True, False, "default"])
def test_to_device_passes_non_blocking_on(ex, monkeypatch, non_blocking):
    seen = []
    original_to = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        positional = [a for a in args if isinstance(a, bool)]
        seen.append(kwargs.get("non_blocking", positional[0] if positional else False))
        return original_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    if non_blocking == "default":  # not given: the default is False (a blocking copy)
        ex.to_device(nested_batch(), META)
        non_blocking = False
    else:
        ex.to_device(nested_batch(), META, non_blocking=non_blocking)
    assert len(seen) == 4, (
        f"Tensor.to was called {len(seen)} times for a batch of 4 tensors; move each tensor "
        "with tensor.to(device, non_blocking=non_blocking)"
    )
    assert all(flag is non_blocking for flag in seen), (
        f"Tensor.to got non_blocking={seen}, expected {non_blocking} for every tensor: "
        "pass the argument on"
    )


# ---------------------------------------------------------------- task0_3: train_step

def small_classifier(seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def classification_batches(n_batches: int, size: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 4, generator=g), torch.randint(0, 3, (size,), generator=g))
            for _ in range(n_batches)]


def parameters_match(model: nn.Module, other) -> bool:
    """Every parameter of ``model`` close to the same-named one in ``other`` (a model or dict)."""
    wanted = dict(other.named_parameters()) if isinstance(other, nn.Module) else other
    return all(torch.allclose(p, wanted[name], rtol=1e-5, atol=1e-6)
               for name, p in model.named_parameters())


@pytest.mark.task0_3
def test_train_step_matches_a_reference_loop_over_two_steps(ex):
    model = small_classifier()
    reference = copy.deepcopy(model)
    # Gradients left over from an earlier step: train_step must clear them before backward.
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    # The same loop without zero_grad, to recognise that mistake by its result.
    stale = copy.deepcopy(model)
    for p in stale.parameters():
        p.grad = torch.full_like(p, 3.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    stale_optimizer = torch.optim.SGD(stale.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()

    for step, (inputs, targets) in enumerate(classification_batches(2, 6), start=1):
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        got = ex.train_step(model, (inputs, targets), loss_fn, optimizer)

        reference_optimizer.zero_grad()
        expected = loss_fn(reference(inputs), targets)
        expected.backward()
        reference_optimizer.step()
        loss_fn(stale(inputs), targets).backward()  # no zero_grad: the gradients pile up
        stale_optimizer.step()

        assert isinstance(got, float), (
            f"step {step}: train_step returned a {type(got).__name__}, expected a Python float "
            "(loss.item(): a tensor would also keep the step's whole autograd graph alive)"
        )
        if parameters_match(model, before):
            pytest.fail(
                f"step {step}: the parameters did not change: call optimizer.step() after "
                "loss.backward(), and optimizer.zero_grad() before the backward, not between "
                "the backward and the step (that wipes the gradients the step needs)"
            )
        if parameters_match(model, stale) and not parameters_match(model, reference):
            pytest.fail(
                f"step {step}: the parameters moved by this batch's gradient plus the gradient "
                "already in .grad before train_step (3.0 everywhere): gradients accumulate, so "
                "call optimizer.zero_grad() before loss.backward()"
            )
        assert_close(got, expected.item(), f"step {step}: loss returned by train_step "
                                           "(the loss of the batch before the update)")
        assert_parameters_close(model, reference, f"step {step}: parameter")


# ---------------------------------------------------------------- task0_4: evaluate

class RecordingClassifier(nn.Module):
    """A linear classifier that records, at each forward, grad mode and training flag."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 2)
        with torch.no_grad():
            self.linear.weight.copy_(torch.tensor([[1.0, -1.0, 0.5], [-0.5, 1.0, -1.0]]))
            self.linear.bias.copy_(torch.tensor([0.1, -0.1]))
        self.seen = []

    def forward(self, x):
        self.seen.append({"grad enabled": torch.is_grad_enabled(), "training": self.training})
        return self.linear(x)


def ten_samples():
    """10 samples in batches of 4, 4 and 2; the short last batch has a much larger loss."""
    g = torch.Generator().manual_seed(2)
    inputs = torch.randn(10, 3, generator=g)
    with torch.no_grad():
        predicted = RecordingClassifier()(inputs).argmax(dim=1)
    targets = predicted.clone()
    targets[8:] = 1 - predicted[8:]  # the last two are confidently wrong
    return DataLoader(TensorDataset(inputs, targets), batch_size=4, shuffle=False)


@pytest.mark.task0_4
def test_evaluate_is_the_exact_mean_over_all_samples(ex):
    loader = ten_samples()
    model = RecordingClassifier()
    loss_fn = nn.CrossEntropyLoss()
    inputs, targets = loader.dataset.tensors
    with torch.no_grad():
        expected = loss_fn(model(inputs), targets).item()
        mean_of_batch_means = sum(loss_fn(model(x), y).item() for x, y in loader) / len(loader)
    assert abs(mean_of_batch_means - expected) > 0.1, "test data no longer tells the two apart"

    got = ex.evaluate(model, loader, loss_fn)

    assert isinstance(got, float), (
        f"evaluate returned a {type(got).__name__}, expected a Python float"
    )
    if math.isclose(got, mean_of_batch_means, rel_tol=1e-5):
        pytest.fail(
            f"evaluate returned {got:.6f}, the mean of the 3 per-batch means; expected "
            f"{expected:.6f}, the mean over all 10 samples: the last batch has 2 samples, not 4, "
            "so weigh each batch's mean loss by its number of samples"
        )
    if math.isclose(got, expected * 10 / 12, rel_tol=1e-5):
        pytest.fail(
            f"evaluate returned {got:.6f}, the sum of the per-sample losses divided by 12 "
            f"(3 batches x 4); expected {expected:.6f}: there are 10 samples, the last batch "
            "holds 2, so divide by the number of samples you actually saw"
        )
    assert_close(got, expected, "evaluate(): mean loss per sample over 10 samples in batches "
                                "of 4, 4, 2")


@pytest.mark.task0_4
@pytest.mark.parametrize("start_in_training_mode", [True, False])
def test_evaluate_uses_eval_mode_no_grad_and_restores_the_mode(ex, start_in_training_mode):
    model = RecordingClassifier()
    model.train(start_in_training_mode)
    ex.evaluate(model, ten_samples(), nn.CrossEntropyLoss())

    assert len(model.seen) == 3, (
        f"the model ran {len(model.seen)} forward passes, expected 3 (one per batch)"
    )
    for i, state in enumerate(model.seen):
        assert not state["grad enabled"], (
            f"batch {i}: gradients were enabled in the forward pass; wrap the loop in "
            "torch.no_grad() (no graph is needed to evaluate, and it costs memory)"
        )
        assert not state["training"], (
            f"batch {i}: the model was in training mode; call model.eval() first (dropout and "
            "batch norm behave differently in eval mode)"
        )
    mode = "training" if start_in_training_mode else "eval"
    assert model.training == start_in_training_mode, (
        f"the model was in {mode} mode before evaluate and in "
        f"{'training' if model.training else 'eval'} mode after; restore the mode it had"
    )
    assert all(p.grad is None for p in model.parameters()), "evaluate must not compute gradients"


# ---------------------------------------------------------------- the lesson's own claims

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
    imitate_machine(monkeypatch, gpus)
    err = refused(train, monkeypatch, capsys, "--device", requested)
    missing = [part for part in expected if part not in err]
    assert not missing, f"the message should say {missing}: {err}"


@pytest.mark.slow
def test_train_script_runs_and_writes_its_result():
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


@pytest.mark.slow
@pytest.mark.parametrize("device_name", ON_CPU_AND_GPU)
def test_fast_one_device_prints_its_ladder(device_name):
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
