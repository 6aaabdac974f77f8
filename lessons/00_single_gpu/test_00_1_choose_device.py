"""task0_1, choose_device: "auto" takes a GPU only when there is one, a request is
honoured, and what cannot be given is refused with a message that says why. The machine's GPUs
are imitated, so every branch is graded on a CPU.

    pytest lessons/00_single_gpu -m task0_1
"""

from __future__ import annotations

import re

import pytest
import torch

from lesson00.common import imitate_machine

# The task's contract, clause by clause, and the tests that fail when only that clause is
# broken (tests/test_course.py checks the names).
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
}


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
    """`None` and `"auto"` give `cuda` on an imitated machine with 2 GPUs and `cpu` on one with none
    (`torch.cuda.is_available` and `device_count` replaced, so it runs on a CPU)."""
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
    """An explicit request is honoured on imitated machines: `"cpu"` gives the CPU with 0 GPUs and
    with 2 (a GPU does not override it); `"cuda"`, `"cuda:0"` and `"cuda:1"` give those devices with
    2 GPUs."""
    imitate_machine(monkeypatch, gpus)
    got = ex.choose_device(requested)
    assert_device(got, device_type, index, describe(requested, gpus))


@pytest.mark.task0_1
@pytest.mark.parametrize("requested", ["cuda", "cuda:0"])
def test_choose_device_refuses_cuda_without_a_gpu(ex, monkeypatch, requested):
    """`"cuda"` and `"cuda:0"` on an imitated machine without a GPU raise a ValueError whose message
    names `cpu` as the way out."""
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
    """What cannot be given raises a ValueError with a message: `"cuda:2"` with 2 GPUs, `"cuda:1"`
    with 1, and `"gpu"`, `"tpu"`, `""` and `"cuda:x"`, on imitated machines."""
    imitate_machine(monkeypatch, gpus)
    assert_refused(ex, requested, gpus, why)


@pytest.mark.task0_1
@pytest.mark.parametrize(("requested", "gpus"), [("cuda:2", 2), ("cuda:5", 2), ("cuda:1", 1)])
def test_choose_device_names_the_valid_range_when_the_index_is_too_high(ex, monkeypatch,
                                                                        requested, gpus):
    """An index too high (`"cuda:2"` or `"cuda:5"` with 2 GPUs, `"cuda:1"` with 1) is refused with a
    message that names the last valid device, `cuda:<count - 1>`, and no other index the machine
    lacks."""
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
