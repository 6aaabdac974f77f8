"""What the test files of lesson 06 share: the running example (its configuration, its batches and
the unsplit model's SGD steps, ``one_process``), the check that each rank holds its slices of the
unsplit parameters, the upstream gradients of every rank, the small layers the split layers are
cut from, and the rank functions more than one task's file runs (``pair_run``, ``refused``).

Every tensor-parallel rank reads the same batch: the whole global batch here, since one process
on the same batch is the reference. The optimizer is SGD: a gradient W times too large (or 1/W)
moves the weights W times too far, where Adam would normalise the mistake away.
"""

from __future__ import annotations

import functools
import re

import torch
import torch.distributed as dist
import torch.distributed.fsdp  # noqa: F401 - imported here once, so that forked ranks have it
import torch.distributed.tensor.parallel  # noqa: F401 - likewise
from gpt import GPT, GPTConfig
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from harness.compare import assert_close
from harness.exercises import load_exercise
from harness.launch import QUICK_SAMPLE
from harness.ranks import group_params

LESSON = "06_tensor_parallel"
SCRIPT = f"lessons/{LESSON}/train_tp.py"
WORLDS = (2, 4)  # the running example's 4 heads split 2 and 4 ways
# gloo with CPU tensors; CUDA: gloo ranks sharing cuda:0, nccl one rank per GPU.
GROUPS = group_params(world_sizes=WORLDS, cuda_world_sizes=(2,), nccl_world_sizes=WORLDS)

# 4 heads of 4 features, 2 blocks, biases on: a bias added W times, or not at all, shows.
CONFIG = dict(vocab_size=29, block_size=8, n_layer=2, n_head=4, n_embd=16, bias=True)
BATCH = 4  # sequences per step
STEPS = 3
SGD = {"lr": 0.5}
# The layers each block splits: by rows (output features) or by columns (input features).
COLUMN = ("q_proj", "k_proj", "v_proj", "up_proj")
ROW = ("out_proj", "down_proj")

# The script checks' run of train_tp.py (conftest.py's script_run) and the GPU check's.
TRAIN = ("--epochs", "1", "--train-windows", "64", *QUICK_SAMPLE)  # 4 steps of 16 windows


# ----------------------------------------------------------------------------- the running example


def make_gpt(**overrides) -> GPT:
    return GPT(GPTConfig(**{**CONFIG, **overrides}), seed=0)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, CONFIG["block_size"] + 1),
                           generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


@functools.cache
def one_process(steps: int = STEPS) -> list[dict[str, torch.Tensor]]:
    """The parameters after each SGD step of the unsplit model on the whole batch."""
    model = make_gpt()
    optimizer = torch.optim.SGD(model.parameters(), **SGD)
    trajectory = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        model(*batch(step))[1].backward()
        optimizer.step()
        trajectory.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return trajectory


def split_dim(name: str) -> int | None:
    """Which dimension of parameter ``name`` the lesson splits across the ranks (None: whole)."""
    layer, _, kind = name.rpartition(".")
    layer = layer.rpartition(".")[2]
    if layer in COLUMN:
        return 0
    if layer in ROW and kind == "weight":
        return 1
    return None


def my_slice(tensor: torch.Tensor, dim: int | None, rank: int, world: int) -> torch.Tensor:
    if dim is None:
        return tensor
    return tensor.chunk(world, dim)[rank]


def assert_slices_of(states: list[dict[str, torch.Tensor]], whole: dict[str, torch.Tensor],
                     what: str, **tolerances) -> None:
    """Each rank's tensors (``states[rank]``, one dict per rank) are its slices of ``whole``:
    rows of the column-parallel layers, columns of the row-parallel weights, the rest whole."""
    __tracebackhide__ = True
    world = len(states)
    for rank, state in enumerate(states):
        missing = sorted(set(whole) - set(state))
        assert not missing, (f"rank {rank}: {what}: no {missing[:3]}; keep the layers' names "
                             f"(q_proj, up_proj, ...) and their weight and bias")
        for name, tensor in whole.items():
            dim = split_dim(name)
            expected = my_slice(tensor, dim, rank, world)
            got = state[name]
            if got.shape != expected.shape:
                how = ("whole, on every rank" if dim is None else
                       f"split along dim {dim} ({'rows' if dim == 0 else 'columns'}): "
                       f"1/{world} of {tuple(tensor.shape)}")
                raise AssertionError(f"rank {rank}: {what} {name!r} has shape "
                                     f"{tuple(got.shape)}, expected {tuple(expected.shape)}: "
                                     f"it is {how}")
            assert_close(got, expected, f"{what} {name!r}", rank, **tolerances)


def local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().clone()


def forward_or_explain(model, inputs, targets, what: str) -> torch.Tensor:
    """The loss, or (when the forward fails on a shape) an error a learner can act on."""
    try:
        return model(inputs, targets)[1]
    except RuntimeError as error:
        raise AssertionError(
            f"the forward of the running example split by {what} failed: "
            f"{str(error).splitlines()[0][:300]}. Each split attention and MLP must end whole "
            f"on every rank: a column-parallel layer's output is this rank's slice of the "
            f"features, a row-parallel layer's is the whole sum") from None


def activation_bytes() -> int:
    """One activation of the residual stream, (batch, tokens, features) fp32: what each of
    tensor parallelism's all-reduces moves."""
    return BATCH * CONFIG["block_size"] * CONFIG["n_embd"] * 4


def rank_weights(rank: int, shape) -> torch.Tensor:
    """A different upstream gradient on every rank (and the same on all with rank=-1)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(500 + rank))


def assert_copies(storage: dict, rank: int, what: str) -> None:
    """Each kept slice owns its memory: a view would keep the whole layer's alive."""
    __tracebackhide__ = True
    for name, (nbytes, needed) in storage.items():
        assert nbytes == needed, (
            f"rank {rank}: {what}'s {name} is a view into a tensor of {nbytes} bytes, but the "
            f"slice needs {needed}: the whole weight stays in memory on every rank. Keep a "
            f"copy of the slice (.clone())")


# ----------------------------------------------------------------------------- small layers

SHAPE = (3, 5)  # task6_1's tensors
IN, HIDDEN, OUT = 8, 12, 6  # the split dimension, 12, divides by 2 and 4


def whole_layer(in_features: int, out_features: int, seed: int) -> nn.Linear:
    layer = nn.Linear(in_features, out_features)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    return layer


# ----------------------------------------------------------------------------- rank functions
# pair_run serves task6_1 and task6_2; refused serves task6_2, task6_3 and task6_4.


def pair_run(ctx, what: str):
    """Two tensor-parallel groups on 4 ranks, [0, 1] and [2, 3], each on data of its own, with
    ``group=`` its own pair: what a 2-D layout's rows do. ``what``: "conjugates" (f and g) or
    "layers" (a column layer, then a row layer)."""
    ex = load_exercise(LESSON)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    pair = ctx.rank // 2
    group = pairs[pair]
    if what == "conjugates":
        x = rank_weights(-10 - pair, SHAPE).requires_grad_(True)  # the same within a pair
        (ex.CopyToParallel.apply(x, group) * rank_weights(ctx.rank, SHAPE)).sum().backward()
        total = ex.ReduceFromParallel.apply(rank_weights(100 + ctx.rank, SHAPE), group)
        return {"f_grad": x.grad, "g_out": total.detach()}
    column = ex.ColumnParallelLinear(whole_layer(IN, HIDDEN, 0), group)
    row = ex.RowParallelLinear(whole_layer(HIDDEN, OUT, 1), group)
    try:
        out = row(column(rank_weights(-20 - pair, (3, IN)))).detach()
    except RuntimeError as error:  # slices of the wrong size: the parent says which
        out = f"RuntimeError: {str(error).splitlines()[0][:200]}"
    return {"weight": column.weight.detach(), "out": out}


def refused(ctx, builder: str, in_features: int, out_features: int, **kwargs):
    """The error ``builder`` raises for a layer whose size does not divide (None: no error)."""
    ex = load_exercise(LESSON)
    layer = whole_layer(in_features, out_features, 2)
    try:
        if builder in ("ColumnParallelLinear", "RowParallelLinear"):
            getattr(ex, builder)(layer)
        elif builder == "TensorParallelAttention":
            model = make_gpt(**kwargs)
            ex.TensorParallelAttention(model.blocks[0].attn)
        else:
            model = make_gpt(**kwargs)
            mesh = init_device_mesh("cpu", (ctx.world_size,))
            ex.parallelize_gpt(model, mesh)
    except NotImplementedError:
        raise
    except ValueError as error:
        return f"ValueError: {error}"
    except Exception as error:  # noqa: BLE001 - the wrong kind of error is the finding
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return None


def assert_refused(results, what: str, size: int, world: int) -> None:
    __tracebackhide__ = True
    for rank, message in enumerate(results):
        assert message is not None, (
            f"rank {rank}: {what} accepted a size of {size} on {world} ranks, which does not "
            f"divide: raise ValueError naming both numbers")
        assert message.startswith("ValueError"), (
            f"rank {rank}: {what} raised {message}; raise ValueError naming {size} and {world}")
        assert re.search(rf"\b{size}\b", message) and re.search(rf"\b{world}\b", message), (
            f"rank {rank}: {what}'s error should name {size} and {world}: {message}")
