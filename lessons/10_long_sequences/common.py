"""What the test files of lesson 10 share: the oracle (attention over the whole sequence, worked
out the slow way in float64), seeded inputs, the splits of a sequence among ranks, and a
dispatch mode that records the largest tensor any operation builds.

Everything is computed in float64 unless a test says otherwise: the graded functions are then
exact to about 1e-12, and a tolerance never hides a mistake.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness.launch import QUICK_SAMPLE
from harness.ranks import group_params

LESSON = "10_long_sequences"
SCRIPT = f"lessons/{LESSON}/ring_attention.py"
SCRIPT_ARGS = ("--batch-size", "2", "--heads", "2", "--length", "32", "--head-dim", "8")
TRAIN_SCRIPT = f"lessons/{LESSON}/train_cp.py"
TRAIN = ("--epochs", "1", "--train-windows", "64", *QUICK_SAMPLE)  # 4 steps of 16 windows
# gloo with CPU tensors (1 to 4 ranks); CUDA: gloo ranks sharing cuda:0, nccl one rank per GPU.
GROUPS = group_params(world_sizes=(1, 2, 3, 4), cuda_world_sizes=(2,))
# The ring sends and receives: gloo has no point-to-point for CUDA tensors, so nccl only there.
RING_GROUPS = group_params(world_sizes=(1, 2, 3, 4), cuda_world_sizes=())
TIGHT = {"rtol": 1e-9, "atol": 1e-9}  # float64 throughout


def seeded(seed: int, *shape: int, dtype=torch.float64, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype) * scale


def reference_attention(q, k, v, q_positions, k_positions, causal: bool = True,
                        scale: float | None = None):
    """(out, lse) of the queries over the keys, the slow and obvious way: a row that sees no key
    gets zeros and -inf. Differentiable."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        visible = k_positions[None, :] <= q_positions[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    seen = torch.isfinite(lse)
    weights = torch.softmax(torch.where(seen[..., None], scores, torch.zeros_like(scores)), -1)
    out = torch.where(seen[..., None], weights @ v, torch.zeros_like(q[..., :1] * v[..., :1, :]))
    return out, lse


def split_positions(layout: str, length: int, world: int) -> list[torch.Tensor]:
    """Each rank's positions of a sequence of ``length``: consecutive blocks, or zig-zag (chunks
    r and 2W-1-r of 2W), worked out here from the rule, not from the graded code."""
    positions = torch.arange(length)
    if layout == "contiguous":
        return list(positions.chunk(world))
    chunks = positions.chunk(2 * world)
    return [torch.cat([chunks[r], chunks[2 * world - 1 - r]]) for r in range(world)]


def visible_pairs(positions: torch.Tensor, length: int) -> int:
    """How many (query, key) pairs a rank's queries at ``positions`` see under a causal mask
    over a sequence of ``length``: its share of attention's work."""
    return int(sum(min(int(p) + 1, length) for p in positions))


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor (in elements) any operation returns while it is active, and
    the largest matrix product (the scores of a block of queries and keys are one), with its
    shape."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.largest_product: tuple[int, tuple[int, ...]] = (0, ())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
                if (func.overloadpacket in (torch.ops.aten.bmm, torch.ops.aten.mm,
                                            torch.ops.aten.matmul, torch.ops.aten.baddbmm)
                        and tensor.numel() > self.largest_product[0]):
                    self.largest_product = (tensor.numel(), tuple(tensor.shape))
        return out


def as_one_failure(check, *args) -> None:
    """Run ``check(*args)``; re-raise its AssertionError from one line, with no context, so that
    hypothesis reports a sweep's failure once rather than one per assertion line it met."""
    failure = None
    try:
        check(*args)
    except AssertionError as error:
        failure = str(error)
    if failure:
        raise AssertionError(failure)


# The first dispatch mode a process enters costs it about 1.5 s (torch imports what
# TorchDispatchMode needs then). Paid once here, at collection: the rank processes forked later
# inherit it instead of each paying it again.
with LargestTensor():
    torch.ones(1) + 1
