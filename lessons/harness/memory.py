"""Bytes of tensors an object holds, found by following its references: memory checks on a CPU.

On a GPU, ``torch.cuda.memory_allocated`` says how much a process holds; on a CPU nothing does.
The sharding lessons' claims are about what each rank keeps (parameters, gradients, optimizer
state), so the checks ask what a model, an optimizer or a sharded wrapper holds::

    from harness.memory import held_bytes, held_tensors

    held_bytes(model)                       # every tensor reachable from the model, in bytes
    held_bytes(optimizer, exclude=[model])  # what the optimizer holds beyond the model
    held_tensors(model)                     # the same, one entry per storage, with a path to it

    with AllocationPeak() as peak:          # the most bytes alive at once while code runs
        model = build()

Every storage is counted once (a view shares its base's), a tensor's ``.grad``, whatever was
set on a tensor as an attribute, and a DTensor's local shard included. A storage resized to
nothing (how FSDP frees an unsharded parameter) counts 0, and a meta tensor has no memory.

The walk follows attributes, containers, hooks and closures, but not module globals, classes or
a function's globals: it counts what the object holds, not what the program holds. Tensors that
autograd saved for backward are not reachable from Python objects and are not counted.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclasses.dataclass(frozen=True)
class Held:
    """One storage: its size, and the first path by which the walk reached it."""

    nbytes: int
    path: str


# Never descended into: what they reach is the program's, not the object's.
_OPAQUE = (type, types.ModuleType, types.CodeType, types.FrameType, types.BuiltinFunctionType,
           str, bytes, bytearray, int, float, complex, bool, torch.device, torch.dtype)


@functools.cache
def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed support
        return ()
    return DTensor


def held_tensors(*roots, exclude=()) -> dict[tuple, Held]:
    """Storage key -> :class:`Held`, for every tensor storage reachable from ``roots`` and not
    from ``exclude``."""
    excluded = _walk(exclude, "excluded") if exclude else {}
    return {key: held for key, held in _walk(roots, "").items() if key not in excluded}


def held_bytes(*roots, exclude=()) -> int:
    """Bytes of every tensor storage reachable from ``roots`` and not from ``exclude``."""
    return sum(held.nbytes for held in held_tensors(*roots, exclude=exclude).values())


def _walk(roots, prefix: str) -> dict[tuple, Held]:
    found: dict[tuple, Held] = {}
    seen: set[int] = set()
    stack = [(root, f"{prefix}[{i}]" if len(roots) > 1 or prefix else _name(root))
             for i, root in enumerate(roots)]
    dtensor = _dtensor_type()
    while stack:
        obj, path = stack.pop()
        if id(obj) in seen or isinstance(obj, _OPAQUE) or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if dtensor and isinstance(obj, dtensor):
                stack.append((obj._local_tensor, f"{path} (local shard)"))
            elif obj.device.type != "meta":
                storage = obj.untyped_storage()
                key = (str(obj.device), storage.data_ptr())
                if storage.nbytes() and key not in found:
                    found[key] = Held(storage.nbytes(), path)
            if obj.is_leaf and obj.grad is not None:  # .grad of a non-leaf warns
                stack.append((obj.grad, f"{path}.grad"))
            # What was set on the tensor itself: a tensor kept on a parameter, its hooks.
            stack.extend((value, f"{path}.{name}") for name, value in vars(obj).items())
            continue
        if isinstance(obj, types.FunctionType):  # a hook or closure: its cells, not its globals
            cells = [cell.cell_contents for cell in obj.__closure__ or ()
                     if _cell_filled(cell)]
            stack.extend((value, f"{path}<closure>") for value in cells)
            stack.extend((value, f"{path}<default>") for value in obj.__defaults__ or ())
            continue
        if isinstance(obj, dict):
            for key, value in obj.items():
                shown = (f"<{type(key).__name__} {tuple(key.shape)}>" if torch.is_tensor(key)
                         else f"{key!r:.40}")
                stack.append((key, f"{path}<key>"))
                stack.append((value, f"{path}[{shown}]"))
            continue
        if isinstance(obj, (list, tuple)):
            stack.extend((value, f"{path}[{i}]") for i, value in enumerate(obj))
            continue
        # Everything the object refers to; its attributes pushed last, so that they are walked
        # first and a storage's path names them ("optimizer.state[...]", "model.blocks").
        attributes = getattr(obj, "__dict__", None)
        attributes = attributes if isinstance(attributes, dict) else {}
        stack.extend((value, f"{path}.{type(value).__name__}") for value in gc.get_referents(obj)
                     if value is not attributes)
        stack.extend((value, f"{path}.{name}") for name, value in attributes.items())
    return found


def _cell_filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _name(obj) -> str:
    return type(obj).__name__


class AllocationPeak(TorchDispatchMode):
    """The most bytes of tensor storage alive at once, among the storages created while it is
    open: a CPU's stand-in for ``torch.cuda.max_memory_allocated`` around one piece of code::

        with AllocationPeak() as peak:
            model = build()
        peak.bytes        # the high-water mark; peak.live_bytes(): what is still alive

        with AllocationPeak(ignore=[*model.parameters(), *grads, *state]) as peak:
            step()        # peak.bytes: what the step needs beyond what it keeps

    It sees every operator torch dispatches (a tensor subclass's, such as a DTensor, by the
    tensors inside it). A storage counts from the first operator that returns a tensor on it
    until the last tensor on it is gone, at its size at the time, both asked after every
    operator: a storage resized to nothing (how FSDP frees a gathered parameter) counts nothing
    until it grows again. A storage from before that an operator returns (a view, an in-place
    result) counts too, unless it is one of ``ignore``'s tensors': so pass what existed before
    and stays. It can err either way: high where an older storage is returned, low for what no
    operator returns (a temporary an operator makes and frees inside itself, such as a
    DTensor's redistribution; a storage filled outside torch's operators) and for a storage
    resized between two operators, which counts from the next one."""

    def __init__(self, ignore=()):
        super().__init__()
        self.bytes = 0
        # StorageImpl address -> (a weak reference, its bytes when seen): an address is stable
        # while the storage lives, however it is resized.
        self._live: dict[int, tuple[object, int]] = {}
        # Held, so that no new storage can take their addresses while this is open.
        self._ignored = {}
        for tensor in _plain(tree_leaves(list(ignore))):
            storage = _storage(tensor)
            if storage is not None:
                self._ignored[storage._cdata] = storage

    def __exit__(self, *exc):
        self._ignored = {}  # let what it held go with the code it watched
        return super().__exit__(*exc)

    def live_bytes(self) -> int:
        """The bytes of the storages it counts that are alive now, at their sizes now; the
        storages gone are forgotten, in the same pass (it runs after every operator): a gone
        storage's weak pointer gives None."""
        total, live = 0, {}
        for key, entry in self._live.items():
            try:
                storage = torch.UntypedStorage._new_with_weak_ptr(entry[0].cdata)
            except RuntimeError:  # torch cannot tell: its size when seen
                live[key] = entry
                total += entry[1]
                continue
            if storage is not None:
                live[key] = entry
                total += storage.nbytes()
        self._live = live
        return total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef

        out = func(*args, **(kwargs or {}))
        total = self.live_bytes()  # what was there before, at its size now
        for tensor in _plain(tree_leaves(out)):
            storage = _storage(tensor)
            if (storage is not None and storage._cdata not in self._live
                    and storage._cdata not in self._ignored):
                self._live[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                total += storage.nbytes()
        self.bytes = max(self.bytes, total)
        return out


def _storage(tensor: torch.Tensor):
    """``tensor``'s untyped storage, or None: a meta tensor has no memory, and a wrapper
    subclass without storage of its own raises."""
    if tensor.device.type == "meta":
        return None
    try:
        storage = tensor.untyped_storage()
        storage.data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return storage


def _plain(leaves):
    """The tensors with storage behind ``leaves``: a wrapper subclass (a DTensor, the
    functional collectives' AsyncCollectiveTensor) holds no storage of its own but the tensors
    its ``__tensor_flatten__`` names."""
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            continue
        if type(leaf) is not torch.Tensor and hasattr(leaf, "__tensor_flatten__"):
            names, _ = leaf.__tensor_flatten__()
            yield from _plain(getattr(leaf, name) for name in names)
        else:
            yield leaf
