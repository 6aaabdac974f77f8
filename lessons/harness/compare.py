"""Tensor comparison whose failure says where, how much, and what was expected.

Tolerances are ``torch.testing.assert_close``'s fp32 defaults (rtol 1.3e-6, atol 1e-5) unless a
test passes looser ones and says why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping

import torch


def _where(what: str, rank: int | None) -> str:
    return f"rank {rank}: {what}" if rank is not None else what


def assert_close(actual, expected, what: str, rank: int | None = None, **tolerances) -> None:
    """Assert two tensors (or numbers) are close; the message names ``what`` and ``rank``."""
    __tracebackhide__ = True  # a learner's traceback ends at the test's line, not in here
    where = _where(what, rank)
    if not isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor):
        raise AssertionError(
            f"{where}: expected a tensor of shape {tuple(expected.shape)}, got "
            f"{type(actual).__name__} {actual!r:.80}"
        )
    actual_t = torch.as_tensor(actual)
    expected_t = torch.as_tensor(expected)
    if actual_t.shape != expected_t.shape:
        raise AssertionError(
            f"{where}: shape {tuple(actual_t.shape)}, expected {tuple(expected_t.shape)}"
        )
    if actual_t.dtype != expected_t.dtype:
        raise AssertionError(f"{where}: dtype {actual_t.dtype}, expected {expected_t.dtype}")
    a = actual_t.detach().cpu()
    e = expected_t.detach().cpu()
    if tolerances:  # torch wants both or neither: fill the other with the fp32 default
        tolerances = {**_isclose_args(tolerances), **tolerances}
    try:
        torch.testing.assert_close(a, e, **tolerances)
    except AssertionError:
        diff = (a.double() - e.double()).abs()
        finite = torch.nan_to_num(diff, nan=float("inf"))
        flat = int(finite.argmax()) if finite.numel() else 0
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape))
        got, want = a.reshape(-1)[flat].item(), e.reshape(-1)[flat].item()
        mismatched = int((~torch.isclose(a.double(), e.double(), **_isclose_args(tolerances)))
                         .sum())
        raise AssertionError(
            f"{where}: {mismatched} of {a.numel()} values differ; largest difference "
            f"{diff.reshape(-1)[flat].item():.3g} at index {list(index)}: got {got:.6g}, "
            f"expected {want:.6g}{_diagnosis(a, e)}"
        ) from None


def _diagnosis(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """A one-line guess when every value is off by the same whole factor (a world size, say)."""
    big = expected.double().abs() > 1e-6
    if int(big.sum()) < 2:
        return ""
    ratio = actual.double()[big] / expected.double()[big]
    mean = float(ratio.mean())
    if float((ratio - mean).abs().max()) > 1e-3 * max(1.0, abs(mean)):
        return ""
    if (times := _whole(mean)) is not None:
        return (f". Every value is {times}x the expected one: did you sum over {times} "
                f"ranks (or micro-batches) without dividing by their number?")
    if mean and (parts := _whole(1 / mean)) is not None:
        return (f". Every value is 1/{parts} of the expected one: did you divide by "
                f"{parts} once too often?")
    return ""


def _whole(factor: float) -> int | None:
    """``factor`` as a whole number of at least 2, when it is one (to 0.1 %)."""
    whole = round(factor)
    return whole if whole >= 2 and abs(factor - whole) < 1e-3 * whole else None


def _isclose_args(tolerances: dict) -> dict:
    return {"rtol": tolerances.get("rtol", 1.3e-6), "atol": tolerances.get("atol", 1e-5)}


def named_tensors(source) -> dict[str, torch.Tensor]:
    """Parameters of a module, or a mapping / iterable of (name, tensor) pairs, as a dict."""
    if isinstance(source, torch.nn.Module):
        return dict(source.named_parameters())
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, Iterable):
        return dict(source)
    raise TypeError(f"cannot read named tensors from {type(source).__name__}")


def assert_parameters_close(actual, expected, what: str = "parameter", rank: int | None = None,
                            grads: bool = False, **tolerances) -> None:
    """Compare every named parameter (or its ``.grad`` with ``grads=True``) of two models."""
    __tracebackhide__ = True
    got, want = named_tensors(actual), named_tensors(expected)
    if set(got) != set(want):
        raise AssertionError(
            f"{_where(what, rank)}: names differ: missing {sorted(set(want) - set(got))}, "
            f"unexpected {sorted(set(got) - set(want))}"
        )
    if grads:  # "gradient of 'w'", or "<what>: gradient of 'w'" when the caller said more
        kind = "gradient of" if what == "parameter" else f"{what}: gradient of"
    else:
        kind = what
    for name in want:
        a, e = got[name], want[name]
        if grads:
            a, e = a.grad, e.grad
            if a is None:
                raise AssertionError(
                    f"{_where(f'{kind} {name!r}', rank)}: is None (no backward reached it)"
                )
        assert_close(a, e, f"{kind} {name!r}", rank, **tolerances)


@contextlib.contextmanager
def full_fp32():
    """Full fp32 matmuls and convolutions inside the block, restored after it: results computed
    on a GPU are compared with a CPU run or with each other, and TF32 (which a GPU may use for
    fp32 work) rounds inputs to 10 mantissa bits. ``allow_tf32`` is read and set the same way
    on every torch the course supports, CPU builds included."""
    previous = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous
