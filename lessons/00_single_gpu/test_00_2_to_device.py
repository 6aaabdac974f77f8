"""task0_2, to_device: a tensor, a tuple, a nested structure or a namedtuple moved to a
device with its shape kept, non_blocking passed on.

    pytest lessons/00_single_gpu -m task0_2
"""

from __future__ import annotations

import collections

import pytest
import torch

# The task's contract, clause by clause, and the tests that fail when only that clause is
# broken (tests/test_course.py checks the names).
CLAUSES = {
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
}


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
    """A single tensor comes back on the `meta` device, its shape and dtype unchanged."""
    tensor = torch.arange(6.0).reshape(2, 3)
    assert_moved(ex.to_device(tensor, META), tensor, "to_device(tensor)")


@pytest.mark.task0_2
def test_to_device_keeps_an_inputs_targets_tuple(ex):
    """An `(inputs, targets)` tuple comes back a tuple of its 2 tensors, both on `meta`, shapes and
    dtypes kept."""
    batch = (torch.randn(4, 3), torch.tensor([0, 1, 1, 0]))
    assert_moved(ex.to_device(batch, META), batch)


@pytest.mark.task0_2
def test_to_device_keeps_a_nested_structure(ex):
    """A dict holding tuples, lists and a dict keeps every container's type and every key in order;
    its 4 tensors move to `meta`, and a string, a number and `None` come back as the very same
    objects."""
    batch = nested_batch()
    assert_moved(ex.to_device(batch, META), batch)


@pytest.mark.task0_2
def test_to_device_keeps_a_namedtuple(ex):
    """A namedtuple `Batch(inputs, targets)` comes back a `Batch`, its two tensors on `meta`."""
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
    """`non_blocking` reaches `Tensor.to`: each of a nested batch's 4 tensors is moved once, with
    `True`, with `False`, and with `False` when the argument is left out (`Tensor.to` wrapped to
    record it)."""
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
