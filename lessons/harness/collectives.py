"""Count what each collective moves, by wrapping ``torch.distributed``'s collective functions.

    from harness.collectives import CollectiveLog

    with CollectiveLog(exercise_module) as log:     # also patches that module's own references
        loss.backward(); optimizer.step()
    log.payload("reduce_scatter")    # bytes of the whole tensors reduce-scattered
    log.count("all_gather")          # how many all-gathers ran
    log.ring_bytes(world_size)       # bytes one rank sends, by the ring formulas below
    log.calls[0].ranks               # how many ranks the first one's group has

The *payload* of a collective is the size of the one tensor it is about: an all-reduce's tensor,
an all-gather's output (the gathered whole), a reduce-scatter's input (the whole before
scattering), a broadcast's tensor, an all-to-all's input (every row this rank sends, its own
included). What a rank *sends* depends on the algorithm; in a ring (the
classic algorithm for large tensors, and one of NCCL's), on W ranks:

- reduce-scatter and all-gather: each rank sends (W - 1) / W of the payload;
- all-reduce (a reduce-scatter, then an all-gather): 2 (W - 1) / W of it;
- broadcast: the source sends the payload once; counted here as (W - 1) / W, its average over
  the ranks of a pipelined ring.

Every name of a collective is wrapped: in ``torch.distributed`` and in ``distributed_c10d``
(where the functions live and call one another), and every attribute of the modules passed in
that refers to one. A collective called from inside another (``all_gather_into_tensor``, which
forwards to ``all_gather_single``, or an object collective's own tensor collectives) counts once,
as the outer one. Not seen: collectives started from C++ (DDP's gradient buckets: count those
with a DDP communication hook), the functional collectives of
``torch.distributed._functional_collectives``, point-to-point and coalesced calls, and
``async_op`` passed by position rather than by name.

What those miss, :class:`DispatchedAllReduces` sees: every all-reduce as torch dispatches it,
from C++ (DDP's reducer and its communication hooks) or from DTensor (functional collectives),
with the dtype and bytes of each tensor it is given::

    with DispatchedAllReduces() as sent:
        loss.backward()
    sent.calls                        # [("torch.float32", 4096), ...], one per tensor
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
import weakref

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode

# function name -> (the collective it is, how to read its payload from the arguments)
_OUTPUT, _INPUT, _TENSOR, _LIST_OUT, _LIST_IN, _NONE = range(6)
_COLLECTIVES = {
    "all_reduce": ("all_reduce", _TENSOR),
    "broadcast": ("broadcast", _TENSOR),
    "all_gather": ("all_gather", _LIST_OUT),
    "all_gather_single": ("all_gather", _OUTPUT),
    "all_gather_into_tensor": ("all_gather", _OUTPUT),
    "_all_gather_base": ("all_gather", _OUTPUT),
    "reduce_scatter": ("reduce_scatter", _LIST_IN),
    "reduce_scatter_single": ("reduce_scatter", _INPUT),
    "reduce_scatter_tensor": ("reduce_scatter", _INPUT),
    "_reduce_scatter_base": ("reduce_scatter", _INPUT),
    "all_to_all_single": ("all_to_all", _INPUT),
    "all_to_all": ("all_to_all", _LIST_IN),
    "all_gather_object": ("all_gather_object", _NONE),
    "broadcast_object_list": ("broadcast_object_list", _NONE),
}
RING_FACTOR = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "broadcast": 1.0}


@dataclasses.dataclass(frozen=True)
class Call:
    op: str  # "all_reduce", "all_gather", "reduce_scatter", "broadcast", ...
    function: str  # the name that was called, e.g. "reduce_scatter_tensor"
    payload: int  # bytes, see the module docstring
    dtype: torch.dtype | None
    async_op: bool
    ranks: int = 0  # how many ranks the collective's group has (0: not known)
    # A weak reference to the payload's tensor (one tensor, not a list): whether the program
    # still holds, say, an all-gather's output after the call can be asked later.
    ref: weakref.ref | None = dataclasses.field(default=None, compare=False, repr=False)

    def alive(self) -> bool:
        """The payload tensor still exists and still has its memory."""
        tensor = self.ref() if self.ref is not None else None
        return tensor is not None and tensor.untyped_storage().nbytes() > 0


def _nbytes(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _payload(kind: int, args, kwargs) -> tuple[int, torch.dtype | None, weakref.ref | None]:
    def arg(position: int, *names: str):
        for name in names:
            if name in kwargs:
                return kwargs[name]
        return args[position] if len(args) > position else None

    if kind == _NONE:
        return 0, None, None
    if kind == _TENSOR:
        tensor = arg(0, "tensor")
    elif kind == _OUTPUT:
        tensor = arg(0, "output_tensor", "output")
    elif kind == _INPUT:
        tensor = arg(1, "input", "input_tensor")
    elif kind == _LIST_OUT:
        tensor = arg(0, "tensor_list")
    else:  # _LIST_IN
        tensor = arg(1, "input_list", "input_tensor_list")
    if tensor is None:
        return 0, None, None
    if isinstance(tensor, torch.Tensor):
        return _nbytes(tensor), tensor.dtype, weakref.ref(tensor)
    first = next(iter(tensor), None)
    return _nbytes(tensor), getattr(first, "dtype", None), None


def _group_size(function, args, kwargs) -> int:
    """The number of ranks in the group a collective is called on (the default group's when
    none is given), or 0 where the arguments do not say (or this rank is not in the group)."""
    try:
        group = inspect.signature(function).bind(*args, **kwargs).arguments.get("group")
        return max(dist.get_world_size(group), 0)
    except (TypeError, ValueError, RuntimeError):
        return 0


class CollectiveLog:
    """A context manager that records every collective called while it is open, then restores
    the real functions. ``calls`` lists them in order."""

    def __init__(self, *modules):
        self.calls: list[Call] = []
        self._modules = modules
        self._patched: list[tuple[object, str, object]] = []
        self._inside = threading.local()

    # -- reading

    def of(self, op: str) -> list[Call]:
        return [call for call in self.calls if call.op == op]

    def count(self, op: str) -> int:
        return len(self.of(op))

    def payload(self, op: str | None = None) -> int:
        """Total payload bytes of ``op`` (or of every collective)."""
        return sum(call.payload for call in self.calls if op is None or call.op == op)

    def ring_bytes(self, world_size: int) -> float:
        """Bytes one rank sends for all the recorded collectives, by the ring formulas."""
        share = (world_size - 1) / world_size
        return sum(RING_FACTOR.get(call.op, 0.0) * share * call.payload for call in self.calls)

    def summary(self) -> str:
        """One line: count and payload per collective, for failure messages."""
        ops = dict.fromkeys(call.op for call in self.calls)
        return ", ".join(f"{self.count(op)} {op} ({_kb(self.payload(op))})" for op in ops) or (
            "no collective")

    # -- patching

    def __enter__(self) -> CollectiveLog:
        real = {name: getattr(c10d, name) for name in _COLLECTIVES if hasattr(c10d, name)}
        owners = [c10d, dist, *self._modules]
        for owner in owners:
            for attribute, value in list(vars(owner).items()):
                for name, function in real.items():
                    if value is function:
                        self._patch(owner, attribute, self._wrap(name, function))
        return self

    def __exit__(self, *exc_info) -> None:
        for owner, attribute, original in reversed(self._patched):
            setattr(owner, attribute, original)
        self._patched.clear()

    def _patch(self, owner, attribute: str, replacement) -> None:
        self._patched.append((owner, attribute, getattr(owner, attribute)))
        setattr(owner, attribute, replacement)

    def _wrap(self, name: str, function):
        op, kind = _COLLECTIVES[name]

        @functools.wraps(function)
        def recorded(*args, **kwargs):
            if getattr(self._inside, "depth", 0):  # called by another collective: counted there
                return function(*args, **kwargs)
            payload, dtype, ref = _payload(kind, args, kwargs)
            self.calls.append(Call(op, name, payload, dtype, bool(kwargs.get("async_op")),
                                   _group_size(function, args, kwargs), ref))
            self._inside.depth = 1
            try:
                return function(*args, **kwargs)
            finally:
                self._inside.depth = 0

        return recorded


def _kb(nbytes: float) -> str:
    return f"{nbytes / 1000:,.1f} kB"


class DispatchedAllReduces(TorchDispatchMode):
    """Records the dtype and bytes of every tensor an all-reduce is dispatched with: c10d's
    ``allreduce_`` (DDP's buckets, a hook's tensor) and the functional ``all_reduce`` (DTensor's
    partial sums). It nests with torch's ``CommDebugMode``, which counts DTensor's collectives
    but not their bytes (and whose module tracking fails around DDP in torch 2.13)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(getattr(func, "_overloadpacket", func))
        if "allreduce" in name.rsplit(".", 1)[-1].replace("_", "") and args:
            tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.calls += [(str(t.dtype), t.numel() * t.element_size()) for t in tensors
                           if isinstance(t, torch.Tensor)]
        return func(*args, **(kwargs or {}))
