"""Lesson 06: tensor parallelism. Layers split by hand, then with DTensor, then 2-D with FSDP2.

What the lesson rests on, checked on gloo/CPU ranks (and on CUDA where present):
- a split layer computes what the whole layer computes: outputs, the input's gradient and the
  weights' gradients, reassembled from every rank's slice, equal the unsplit layer's;
- the split running example trains as the unsplit one does, step after step;
- each forward and backward runs the collectives the text counts, and moves the bytes it says,
  counted by wrapping the collectives (``harness.collectives``) or by torch's ``CommDebugMode``.

Every tensor-parallel rank reads the same batch: the whole global batch here, since one process
on the same batch is the reference. The optimizer is SGD: a gradient W times too large (or 1/W)
moves the weights W times too far, where Adam would normalise the mistake away.
"""

from __future__ import annotations

import copy
import functools
import re

import pytest
import torch
import torch._dynamo  # noqa: F401 - the first fully_shard() imports it: a second per rank
import torch.distributed as dist
import torch.distributed.fsdp  # noqa: F401 - imported here once, so that forked ranks have it
import torch.distributed.tensor.parallel  # noqa: F401 - likewise
from gpt import GPT, SIZES, CharDataset, GPTConfig, parameter_digest
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from harness.collectives import CollectiveLog, DispatchedAllReduces
from harness.compare import assert_close, assert_parameters_close, full_fp32
from harness.exercises import load_exercise, load_lesson_module, raise_if_untouched
from harness.hardware import gpu_marks
from harness.launch import one_process_fit, run_script, start_first, start_script
from harness.ranks import group_params, run_on_ranks

LESSON = "06_tensor_parallel"
SCRIPT = f"lessons/{LESSON}/train_tp.py"
WORLDS = (2, 4)  # the running example's 4 heads split 2 and 4 ways
# gloo with CPU tensors; CUDA: gloo ranks sharing cuda:0, nccl one rank per GPU.
GROUPS = group_params(world_sizes=WORLDS, cuda_world_sizes=(2,), nccl_world_sizes=WORLDS)

# DTensor with gloo on CUDA tensors is not a combination the course has run: nccl only on GPUs.
DTENSOR_GROUPS = group_params(world_sizes=WORLDS, cuda_world_sizes=(), nccl_world_sizes=WORLDS)

# 4 heads of 4 features, 2 blocks, biases on: a bias added W times, or not at all, shows.
CONFIG = dict(vocab_size=29, block_size=8, n_layer=2, n_head=4, n_embd=16, bias=True)
BATCH = 4  # sequences per step
STEPS = 3
SGD = {"lr": 0.5}
# The layers each block splits: by rows (output features) or by columns (input features).
COLUMN = ("q_proj", "k_proj", "v_proj", "up_proj")
ROW = ("out_proj", "down_proj")

# Each task's contract, clause by clause, and the tests that fail when only that clause is broken (tests/test_course.py checks the names).  # noqa: E501
CLAUSES = {
    "task6_1": {
        "CopyToParallel forward: x unchanged, no communication":
            ["test_copy_to_parallel_sums_the_gradient_in_backward"],
        "CopyToParallel backward: the sum over the group's ranks of the gradients, an all-reduce":
            ["test_copy_to_parallel_sums_the_gradient_in_backward"],
        "CopyToParallel: the group's ranks only": [
            "test_conjugates_reduce_within_their_group_only"],
        "CopyToParallel backward returns (gradient, None)":
            ["test_copy_to_parallel_sums_the_gradient_in_backward"],
        "all-reduce a copy, never the tensor autograd hands in":
            ["test_copy_to_parallel_sums_the_gradient_in_backward"],
        "ReduceFromParallel forward: the sum over the group's ranks of x, an all-reduce":
            ["test_reduce_from_parallel_sums_in_forward_only",
             "test_conjugates_reduce_within_their_group_only"],
        "ReduceFromParallel forward: all-reduce a copy":
            ["test_reduce_from_parallel_sums_in_forward_only"],
        "ReduceFromParallel backward: the gradient unchanged, no communication; (gradient, None)":
            ["test_reduce_from_parallel_sums_in_forward_only"],
    },
    "task6_2": {
        "ColumnParallelLinear: n = split_size(out_features, W, 'out_features')":
            ["test_split_layers_refuse_sizes_that_do_not_divide"],
        "ColumnParallelLinear: keep weight[rank*n:(rank+1)*n] and the same slice of the bias":
            ["test_column_parallel_linear_equals_the_unsplit_layer",
             "test_split_layers_use_their_group_only"],
        "ColumnParallelLinear: bias None when the layer has no bias":
            ["test_split_layers_of_a_layer_without_bias_have_none"],
        "both new nn.Parameters (copies: the whole layer can then be freed)":
            ["test_column_parallel_linear_equals_the_unsplit_layer"],
        "ColumnParallelLinear.forward: returns (..., n), this rank's slice, no communication":
            ["test_column_parallel_linear_equals_the_unsplit_layer"],
        "with copy_input (the default), x first goes through copy_to_parallel":
            ["test_column_parallel_linear_equals_the_unsplit_layer"],
        "copy_input=False: the caller has already done so":
            ["test_column_parallel_linear_without_copy_input_leaves_the_copy_to_the_caller"],
        "rank and W are those of group": ["test_split_layers_use_their_group_only"],
        "RowParallelLinear: n = split_size(in_features, W, 'in_features')":
            ["test_split_layers_refuse_sizes_that_do_not_divide"],
        "RowParallelLinear: keep weight[:, rank*n:(rank+1)*n], and the whole bias":
            ["test_row_parallel_linear_equals_the_unsplit_layer"],
        "RowParallelLinear: bias None without one":
            ["test_split_layers_of_a_layer_without_bias_have_none"],
        "RowParallelLinear.forward: partial sum, reduce_from_parallel, then the bias once":
            ["test_row_parallel_linear_equals_the_unsplit_layer",
             "test_split_layers_use_their_group_only"],
        "returns (..., out_features), whole and the same on every rank":
            ["test_row_parallel_linear_equals_the_unsplit_layer"],
    },
    "task6_3": {
        "TensorParallelMLP: up_proj a ColumnParallelLinear, down_proj a RowParallelLinear":
            ["test_split_attention_and_mlp_give_the_input_its_whole_gradient",
             "test_tensor_parallel_gpt_trains_like_the_unsplit_model"],
        "self.drop = mlp.drop; it is an MLP, so MLP.forward runs as it is":
            ["test_tensor_parallel_gpt_trains_like_the_unsplit_model"],
        "one all-reduce per forward and one per backward":
            ["test_tensor_parallel_gpt_trains_like_the_unsplit_model"],
        "TensorParallelMLP(mlp, group): its layers split within group":
            ["test_split_blocks_use_their_group_only"],
        "TensorParallelAttention: the number of heads must divide by W (split_size)":
            ["test_split_attention_refuses_heads_that_do_not_divide"],
        "q_proj, k_proj and v_proj ColumnParallelLinears with copy_input=False":
            ["test_tensor_parallel_gpt_trains_like_the_unsplit_model"],
        "out_proj a RowParallelLinear": [
            "test_split_attention_and_mlp_give_the_input_its_whole_gradient",
            "test_tensor_parallel_gpt_trains_like_the_unsplit_model"],
        "head_dim, dropout and resid_drop are kept":
            ["test_tensor_parallel_gpt_trains_like_the_unsplit_model"],
        "group as self.group for the forward": ["test_split_blocks_use_their_group_only"],
        "forward: copy_to_parallel(x, group) once, for all three projections":
            ["test_split_attention_and_mlp_give_the_input_its_whole_gradient",
             "test_tensor_parallel_gpt_trains_like_the_unsplit_model"],
        "then CausalSelfAttention.forward as it is":
            ["test_tensor_parallel_gpt_trains_like_the_unsplit_model"],
        "tensor_parallel_blocks: each block.attn a TensorParallelAttention, block.mlp a "
        "TensorParallelMLP": ["test_tensor_parallel_gpt_trains_like_the_unsplit_model"],
        "tensor_parallel_blocks splits in place": [
            "test_tensor_parallel_blocks_splits_the_model_in_place"],
        "tensor_parallel_blocks(model, group) splits within group":
            ["test_split_blocks_use_their_group_only"],
        "everything else stays whole and replicated":
            ["test_tensor_parallel_gpt_trains_like_the_unsplit_model"],
        "returns model": ["test_tensor_parallel_gpt_trains_like_the_unsplit_model",
                          "test_tensor_parallel_blocks_splits_the_model_in_place"],
    },
    "task6_4": {
        "attn.q_proj, attn.k_proj, attn.v_proj, mlp.up_proj: ColwiseParallel()":
            ["test_parallelize_gpt_splits_and_trains_as_the_hand_version"],
        "attn.out_proj, mlp.down_proj: RowwiseParallel()":
            ["test_parallelize_gpt_splits_and_trains_as_the_hand_version"],
        "attn: PrepareModuleInput(..., use_local_output=False): one all-reduce, not three":
            ["test_parallelize_gpt_splits_and_trains_as_the_hand_version"],
        "split_size the number of heads and the MLP's hidden size by mesh.size() first":
            ["test_parallelize_gpt_refuses_heads_that_do_not_divide"],
        "parallelize_module(block, mesh, block_plan()) for every block; returns model":
            ["test_parallelize_gpt_splits_and_trains_as_the_hand_version"],
    },
    "task6_5": {
        "parallelize_gpt(model, mesh['tp']) first":
            ["test_2d_trains_like_one_process_on_the_whole_batch"],
        "fully_shard(block, mesh=mesh['dp']) for every block":
            ["test_2d_trains_like_one_process_on_the_whole_batch"],
        "then fully_shard(model, mesh=mesh['dp'])":
            ["test_2d_trains_like_one_process_on_the_whole_batch"],
        "each TP slice is sharded again across the data-parallel ranks (the mesh's columns)":
            ["test_2d_trains_like_one_process_on_the_whole_batch"],
        "a mesh without the two names raises a ValueError saying what it needs":
            ["test_2d_refuses_a_mesh_without_dp_and_tp",
             "test_2d_refuses_a_2d_mesh_named_otherwise"],
    },
}


@pytest.fixture
def ex():
    return load_exercise(LESSON)


# ----------------------------------------------------------------------------- shared pieces


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


def short_op(op) -> str:
    """CommDebugMode's key (an operator) by its collective's name: 'all_reduce', ..."""
    name = str(op).rpartition(".")[2].strip("_")
    return {"allgather_base": "all_gather", "reduce_scatter_base": "reduce_scatter",
            "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"
            }.get(name, name)


def comm_counts(mode: CommDebugMode) -> dict[str, int]:
    counts: dict[str, int] = {}
    for op, count in mode.get_comm_counts().items():
        counts[short_op(op)] = counts.get(short_op(op), 0) + count
    return counts


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


# ----------------------------------------------------------------------------- task6_1 f and g

SHAPE = (3, 5)


def conjugate_run(ctx, which: str, residual: bool):
    """``which`` of f and g on this rank, forward and backward, with the collectives counted.

    f: x is the same on every rank; the loss is (f(x) * c_rank).sum(), so the whole gradient of
    x is the sum of every rank's c. With ``residual`` the loss is ((f(x) + x) * c).sum(), where
    autograd gives f's backward and x's other path the same gradient tensor.
    g: x differs on every rank; the loss is (g(x) * c).sum() with c the same everywhere.
    """
    ex = load_exercise(LESSON)
    device = ctx.device
    if which == "f":
        base = rank_weights(-1, SHAPE).to(device)
        c = rank_weights(ctx.rank, SHAPE).to(device)
        apply = ex.CopyToParallel.apply
    else:
        base = rank_weights(100 + ctx.rank, SHAPE).to(device)
        c = rank_weights(-1, SHAPE).to(device)
        apply = ex.ReduceFromParallel.apply
    x = base.clone().requires_grad_(True)
    with CollectiveLog(ex) as forward:
        y = apply(x, None)
    out = y + x if residual else y
    with CollectiveLog(ex) as backward:
        (out * c).sum().backward()
    return {"y": y.detach(), "x_after": x.detach(), "base": base, "grad": x.grad,
            "forward": [(call.op, call.payload) for call in forward.calls],
            "backward": [(call.op, call.payload) for call in backward.calls]}


def conjugate_diagnosis(grad: torch.Tensor, expected: torch.Tensor, own: torch.Tensor,
                        world: int) -> str:
    if torch.allclose(grad, own, atol=1e-5) and not torch.allclose(own, expected, atol=1e-5):
        return (f": it is this rank's own part only; the other {world - 1} rank(s)' parts "
                f"are missing. f's backward must all-reduce (sum) the gradient")
    if torch.allclose(grad, world * expected, rtol=1e-4, atol=1e-5):
        return (f": it is {world}x the expected one: one all-reduce too many in backward "
                f"(f's backward all-reduces once; g's passes the gradient through)")
    return ""


@pytest.mark.task6_1
@pytest.mark.parametrize("residual", [False, True], ids=["alone", "beside-a-residual"])
@pytest.mark.parametrize("group", GROUPS)
def test_copy_to_parallel_sums_the_gradient_in_backward(ex, group, residual):
    world, backend, device = group
    raise_if_untouched(ex.CopyToParallel.forward, ex.CopyToParallel.backward)
    results = run_on_ranks(conjugate_run, "f", residual, world_size=world, backend=backend,
                           device=device)
    total = sum(rank_weights(r, SHAPE) for r in range(world))
    nbytes = 4 * total.numel()
    for rank, got in enumerate(results):
        assert_close(got["y"], got["base"], "CopyToParallel's forward output (x, unchanged)",
                     rank)
        assert not got["forward"], (
            f"rank {rank}: CopyToParallel's forward ran {got['forward']}: every rank already "
            f"holds x whole, the forward communicates nothing")
        # With the residual, x's own path adds this rank's c once more, unreduced.
        own = rank_weights(rank, SHAPE)
        expected = total + own if residual else total
        grad = got["grad"]
        if grad is None:
            raise AssertionError(f"rank {rank}: x.grad is None: the backward must return the "
                                 f"gradient of x (and None for the group)")
        why = conjugate_diagnosis(grad, expected, own * (2 if residual else 1), world)
        if residual and not why and torch.allclose(grad, 2 * total, atol=1e-4):
            why = (": the residual path's gradient was all-reduced too: f's backward changed "
                   "the gradient tensor autograd handed in, which the residual path shares. "
                   "All-reduce a copy (grad.clone())")
        try:
            assert_close(grad, expected, "the gradient of x through CopyToParallel", rank)
        except AssertionError as error:
            raise AssertionError(f"{error}{why}") from None
        assert [op for op, _ in got["backward"]] == ["all_reduce"], (
            f"rank {rank}: CopyToParallel's backward ran {got['backward'] or 'no collective'}: "
            f"expected one all_reduce of the gradient")
        assert got["backward"][0][1] == nbytes, (
            f"rank {rank}: the backward all-reduced {got['backward'][0][1]} bytes, expected "
            f"{nbytes} (the gradient of x, {SHAPE} fp32)")


@pytest.mark.task6_1
@pytest.mark.parametrize("group", GROUPS)
def test_reduce_from_parallel_sums_in_forward_only(ex, group):
    world, backend, device = group
    raise_if_untouched(ex.ReduceFromParallel.forward, ex.ReduceFromParallel.backward)
    results = run_on_ranks(conjugate_run, "g", False, world_size=world, backend=backend,
                           device=device)
    total = sum(rank_weights(100 + r, SHAPE) for r in range(world))
    upstream = rank_weights(-1, SHAPE)
    for rank, got in enumerate(results):
        assert [op for op, _ in got["forward"]] == ["all_reduce"], (
            f"rank {rank}: ReduceFromParallel's forward ran {got['forward'] or 'no collective'}"
            f": expected one all_reduce, the sum of every rank's partial result")
        assert_close(got["y"], total, "ReduceFromParallel's forward (the sum over ranks)", rank)
        if not torch.equal(got["x_after"], got["base"]):
            raise AssertionError(f"rank {rank}: ReduceFromParallel's forward changed its input "
                                 f"x in place: all-reduce a copy (x.clone())")
        assert not got["backward"], (
            f"rank {rank}: ReduceFromParallel's backward ran {got['backward']}: the gradient "
            f"of a sum with respect to each term is the sum's own gradient, no communication")
        try:
            assert_close(got["grad"], upstream, "the gradient of x through ReduceFromParallel",
                         rank)
        except AssertionError as error:
            raise AssertionError(f"{error}. The backward passes the gradient through "
                                 f"unchanged") from None


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


def pair_diagnosis(got: torch.Tensor, everyone: torch.Tensor) -> str:
    if torch.allclose(got, everyone, atol=1e-5):
        return (": that is the sum over all 4 ranks, not over this rank's group of 2. Pass "
                "group= to dist.all_reduce")
    return ""


@pytest.mark.task6_1
def test_conjugates_reduce_within_their_group_only(ex):
    raise_if_untouched(ex.CopyToParallel.backward, ex.ReduceFromParallel.forward)
    results = run_on_ranks(pair_run, "conjugates", world_size=4)
    for rank, got in enumerate(results):
        mates = [2 * (rank // 2), 2 * (rank // 2) + 1]
        for key, offset, what in (("f_grad", 0, "the gradient through CopyToParallel"),
                                  ("g_out", 100, "ReduceFromParallel's output")):
            expected = sum(rank_weights(offset + r, SHAPE) for r in mates)
            everyone = sum(rank_weights(offset + r, SHAPE) for r in range(4))
            try:
                assert_close(got[key], expected, f"{what} with group={mates}", rank)
            except AssertionError as error:
                raise AssertionError(f"{error}{pair_diagnosis(got[key], everyone)}") from None


def bias_hint(extra: torch.Tensor, bias: torch.Tensor, world: int) -> str:
    """What a row-parallel output that is off by a multiple of the bias says."""
    bias = bias.detach().expand_as(extra)
    if torch.allclose(extra, (world - 1) * bias, atol=1e-4):
        return (f": it has {world - 1} bias(es) too many: every rank added the bias before "
                f"the all-reduce. Add it once, after")
    if torch.allclose(extra, -bias, atol=1e-4):
        return ": the bias is missing"
    return ""


@pytest.mark.task6_2
def test_split_layers_use_their_group_only(ex):
    raise_if_untouched(ex.ColumnParallelLinear.__init__, ex.RowParallelLinear.__init__)
    results = run_on_ranks(pair_run, "layers", world_size=4)
    column, row = whole_layer(IN, HIDDEN, 0), whole_layer(HIDDEN, OUT, 1)
    for rank, got in enumerate(results):
        mates, mine = [2 * (rank // 2), 2 * (rank // 2) + 1], rank % 2
        rows = column.weight.detach().chunk(2)[mine]
        if got["weight"].shape != rows.shape:
            whole_world = got["weight"].shape == column.weight.chunk(4)[0].shape
            raise AssertionError(
                f"rank {rank}: with group={mates} ColumnParallelLinear keeps a weight of shape "
                f"{tuple(got['weight'].shape)}, expected {tuple(rows.shape)}: half of the rows"
                + (", its group has 2 ranks. Use dist.get_world_size(group) and "
                   "dist.get_rank(group), not the whole world's" if whole_world else ""))
        assert_close(got["weight"], rows, f"ColumnParallelLinear's weight with group={mates} "
                     f"(rank {mine} of its group)", rank)
        assert not isinstance(got["out"], str), (
            f"rank {rank}: a column layer then a row layer, group={mates}: {got['out']}")
        with torch.no_grad():
            expected = row(column(rank_weights(-20 - rank // 2, (3, IN))))
        try:
            assert_close(got["out"], expected, f"a column layer then a row layer, "
                         f"group={mates}", rank)
        except AssertionError as error:
            raise AssertionError(f"{error}{bias_hint(got['out'] - expected, row.bias, 2)}"
                                 ) from None


# ----------------------------------------------------------------------------- task6_2 layers

IN, HIDDEN, OUT = 8, 12, 6  # the split dimension, 12, divides by 2 and 4


def whole_layer(in_features: int, out_features: int, seed: int) -> nn.Linear:
    layer = nn.Linear(in_features, out_features)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    return layer


def whole_layer_run(layer: nn.Linear, x: torch.Tensor, c: torch.Tensor) -> dict:
    """The unsplit layer's output and gradients for the loss (layer(x) * c).sum()."""
    layer, x = copy.deepcopy(layer), x.clone().requires_grad_(True)
    out = layer(x)
    (out * c).sum().backward()
    return {"out": out.detach(), "x_grad": x.grad, "weight_grad": layer.weight.grad,
            "bias_grad": layer.bias.grad}


def split_layer_run(ctx, kind: str):
    """A ColumnParallelLinear (kind "column") of a 8 -> 12 layer, or a RowParallelLinear ("row")
    of a 12 -> 6 layer, forward and backward on this rank; its slices gathered afterwards."""
    ex = load_exercise(LESSON)
    device, rank, world = ctx.device, ctx.rank, ctx.world_size
    with full_fp32():  # compared with a CPU run: no TF32
        x = rank_weights(-2, (3, IN if kind == "column" else HIDDEN)).to(device)
        if kind == "column":
            layer = ex.ColumnParallelLinear(whole_layer(IN, HIDDEN, 0).to(device))
            mine = x.clone().requires_grad_(True)
        else:
            layer = ex.RowParallelLinear(whole_layer(HIDDEN, OUT, 1).to(device))
            mine = x.chunk(world, 1)[rank].clone().requires_grad_(True)
        c = rank_weights(-3, (3, HIDDEN if kind == "column" else OUT)).to(device)
        if kind == "column":
            c = c.chunk(world, 1)[rank]
        kept = {name: p.detach().clone() for name, p in layer.named_parameters()}
        storage = {name: (p.untyped_storage().nbytes(), p.numel() * p.element_size())
                   for name, p in layer.named_parameters()}
        with CollectiveLog(ex) as forward:
            try:
                out = layer(mine)
            except RuntimeError as error:  # a slice of the wrong shape: the parent explains it
                return {"kept": kept, "storage": storage, "error": str(error).splitlines()[0][:200]}
        with CollectiveLog(ex) as backward:
            (out * c).sum().backward()
        grads = {name: p.grad for name, p in layer.named_parameters()}
        return {"kept": kept, "storage": storage, "out": out.detach(), "x_grad": mine.grad,
                "grads": grads,
                "forward": [call.op for call in forward.calls],
                "backward": [call.op for call in backward.calls]}


def assert_copies(storage: dict, rank: int, what: str) -> None:
    """Each kept slice owns its memory: a view would keep the whole layer's alive."""
    __tracebackhide__ = True
    for name, (nbytes, needed) in storage.items():
        assert nbytes == needed, (
            f"rank {rank}: {what}'s {name} is a view into a tensor of {nbytes} bytes, but the "
            f"slice needs {needed}: the whole weight stays in memory on every rank. Keep a "
            f"copy of the slice (.clone())")


def assert_ran(got: dict, rank: int, what: str) -> None:
    __tracebackhide__ = True
    assert_copies(got["storage"], rank, what)
    if "error" in got:
        raise AssertionError(f"rank {rank}: {what}'s forward raised RuntimeError: "
                             f"{got['error']}")


@pytest.mark.task6_2
@pytest.mark.parametrize("group", GROUPS)
def test_column_parallel_linear_equals_the_unsplit_layer(ex, group):
    world, backend, device = group
    raise_if_untouched(ex.ColumnParallelLinear.__init__, ex.ColumnParallelLinear.forward)
    results = run_on_ranks(split_layer_run, "column", world_size=world, backend=backend,
                           device=device)
    layer = whole_layer(IN, HIDDEN, 0)
    x, c = rank_weights(-2, (3, IN)), rank_weights(-3, (3, HIDDEN))
    want = whole_layer_run(layer, x, c)
    for rank, got in enumerate(results):
        assert set(got["kept"]) == {"weight", "bias"}, (
            f"rank {rank}: ColumnParallelLinear's parameters are {sorted(got['kept'])}: "
            f"expected weight and bias (this rank's slices), nothing else")
        rows = slice(rank * HIDDEN // world, (rank + 1) * HIDDEN // world)
        for name, tensor in (("weight", layer.weight), ("bias", layer.bias)):
            kept = got["kept"][name]
            assert kept.shape == tensor[rows].shape, (
                f"rank {rank}: ColumnParallelLinear keeps a {name} of shape "
                f"{tuple(kept.shape)}; its slice of the whole {tuple(tensor.shape)} is rows "
                f"{rows.start}:{rows.stop}, shape {tuple(tensor[rows].shape)}")
            assert_close(kept, tensor[rows].detach(), f"ColumnParallelLinear's {name}", rank)
        assert_ran(got, rank, "ColumnParallelLinear")
        assert_close(got["out"], want["out"][:, rows], "ColumnParallelLinear's output (this "
                     "rank's output features)", rank)
        assert got["forward"] == [], (
            f"rank {rank}: the column-parallel forward ran {got['forward']}: it needs no "
            f"communication (x is whole on every rank)")
        try:
            assert_close(got["x_grad"], want["x_grad"], "the gradient of the input x", rank)
        except AssertionError as error:
            ranks_sum = sum(r["x_grad"] for r in results)
            hint = (": summed over the ranks it would be right. Put x through "
                    "copy_to_parallel first (copy_input=True): its backward all-reduces"
                    if torch.allclose(ranks_sum, want["x_grad"], atol=1e-4) else "")
            raise AssertionError(f"{error}{hint}") from None
    for name in ("weight", "bias"):
        gathered = torch.cat([r["grads"][name] for r in results], 0)
        assert_close(gathered, want[f"{name}_grad"], f"ColumnParallelLinear's {name} gradients, "
                     f"every rank's slice put back together")


@pytest.mark.task6_2
@pytest.mark.parametrize("group", GROUPS)
def test_row_parallel_linear_equals_the_unsplit_layer(ex, group):
    world, backend, device = group
    raise_if_untouched(ex.RowParallelLinear.__init__, ex.RowParallelLinear.forward)
    results = run_on_ranks(split_layer_run, "row", world_size=world, backend=backend,
                           device=device)
    layer = whole_layer(HIDDEN, OUT, 1)
    x, c = rank_weights(-2, (3, HIDDEN)), rank_weights(-3, (3, OUT))
    want = whole_layer_run(layer, x, c)
    for rank, got in enumerate(results):
        columns = slice(rank * HIDDEN // world, (rank + 1) * HIDDEN // world)
        kept = got["kept"]
        assert set(kept) == {"weight", "bias"}, (
            f"rank {rank}: RowParallelLinear's parameters are {sorted(kept)}: expected weight "
            f"(this rank's columns) and bias (whole)")
        assert kept["weight"].shape == layer.weight[:, columns].shape, (
            f"rank {rank}: RowParallelLinear keeps a weight of shape "
            f"{tuple(kept['weight'].shape)}; its slice of the whole {tuple(layer.weight.shape)}"
            f" is columns {columns.start}:{columns.stop}")
        assert_close(kept["weight"], layer.weight[:, columns].detach(),
                     "RowParallelLinear's weight", rank)
        assert_close(kept["bias"], layer.bias.detach(), "RowParallelLinear's bias (whole on "
                     "every rank)", rank)
        assert_ran(got, rank, "RowParallelLinear")
        assert got["forward"] == ["all_reduce"], (
            f"rank {rank}: the row-parallel forward ran {got['forward'] or 'no collective'}: "
            f"expected one all_reduce of the partial sums")
        try:
            assert_close(got["out"], want["out"], "RowParallelLinear's output", rank)
        except AssertionError as error:
            hint = bias_hint(got["out"] - want["out"], layer.bias, world)
            raise AssertionError(f"{error}{hint}") from None
        assert_close(got["x_grad"], want["x_grad"][:, columns], "the gradient of this rank's "
                     "slice of x", rank)
        assert_close(got["grads"]["bias"], want["bias_grad"], "RowParallelLinear's bias "
                     "gradient (whole, on every rank)", rank)
    gathered = torch.cat([r["grads"]["weight"] for r in results], 1)
    assert_close(gathered, want["weight_grad"], "RowParallelLinear's weight gradients, every "
                 "rank's columns put back together")


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


@pytest.mark.task6_2
@pytest.mark.parametrize("builder,in_features,out_features,size", [
    ("ColumnParallelLinear", 8, 6, 6), ("RowParallelLinear", 6, 8, 6)], ids=["column", "row"])
def test_split_layers_refuse_sizes_that_do_not_divide(ex, builder, in_features, out_features,
                                                       size):
    raise_if_untouched(getattr(ex, builder).__init__)
    results = run_on_ranks(refused, builder, in_features, out_features, world_size=4)
    assert_refused(results, builder, size, 4)


def layers_without_bias(ctx) -> dict:
    """A column layer (8 -> 12) and a row layer (12 -> 6), both made from nn.Linear(...,
    bias=False): their bias, and a column-then-row forward."""
    ex = load_exercise(LESSON)
    built = {}
    for kind, builder, (n_in, n_out) in (("column", ex.ColumnParallelLinear, (IN, HIDDEN)),
                                         ("row", ex.RowParallelLinear, (HIDDEN, OUT))):
        layer = whole_layer(n_in, n_out, 4)
        layer.bias = None
        try:
            built[kind] = builder(layer)
        except NotImplementedError:
            raise
        except Exception as error:  # noqa: BLE001 - the learner's error is the finding
            return {"error": f"{builder.__name__}(nn.Linear({n_in}, {n_out}, bias=False)) "
                             f"raised {type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    out = built["row"](built["column"](rank_weights(-6, (3, IN))))
    return {"bias": {kind: layer.bias for kind, layer in built.items()}, "out": out.detach()}


@pytest.mark.task6_2
def test_split_layers_of_a_layer_without_bias_have_none(ex):
    raise_if_untouched(ex.ColumnParallelLinear.__init__, ex.RowParallelLinear.__init__)
    results = run_on_ranks(layers_without_bias, world_size=2)
    column, row = whole_layer(IN, HIDDEN, 4), whole_layer(HIDDEN, OUT, 4)
    column.bias, row.bias = None, None
    with torch.no_grad():
        expected = row(column(rank_weights(-6, (3, IN))))
    for rank, got in enumerate(results):
        assert "error" not in got, (
            f"rank {rank}: {got.get('error')}: a layer without a bias gives a split layer "
            f"whose bias is None")
        for kind, bias in got["bias"].items():
            name = {"column": "ColumnParallelLinear", "row": "RowParallelLinear"}[kind]
            assert bias is None, (
                f"rank {rank}: {name} of a layer without a bias has a bias of shape "
                f"{tuple(bias.shape)}: keep self.bias = None when linear.bias is None")
        assert_close(got["out"], expected, "a column layer then a row layer, both without bias",
                     rank)


def column_without_copy(ctx) -> dict:
    """ColumnParallelLinear(..., copy_input=False): the input's gradient on this rank, and the
    collectives of the backward."""
    ex = load_exercise(LESSON)
    layer = ex.ColumnParallelLinear(whole_layer(IN, HIDDEN, 0), copy_input=False)
    x = rank_weights(-2, (3, IN)).requires_grad_(True)
    c = rank_weights(-3, (3, HIDDEN)).chunk(ctx.world_size, 1)[ctx.rank]
    out = layer(x)
    with CollectiveLog(ex) as backward:
        (out * c).sum().backward()
    return {"x_grad": x.grad, "backward": [call.op for call in backward.calls]}


@pytest.mark.task6_2
def test_column_parallel_linear_without_copy_input_leaves_the_copy_to_the_caller(ex):
    raise_if_untouched(ex.ColumnParallelLinear.__init__, ex.ColumnParallelLinear.forward)
    results = run_on_ranks(column_without_copy, world_size=2)
    weight = whole_layer(IN, HIDDEN, 0).weight.detach()
    for rank, got in enumerate(results):
        assert not got["backward"], (
            f"rank {rank}: ColumnParallelLinear(..., copy_input=False)'s backward ran "
            f"{got['backward']}: with copy_input=False the caller has put x through "
            f"copy_to_parallel already, for several layers at once; the layer must not again")
        own = rank_weights(-3, (3, HIDDEN)).chunk(2, 1)[rank] @ weight.chunk(2, 0)[rank]
        assert_close(got["x_grad"], own, "with copy_input=False, the gradient of x: this "
                     "rank's own part, left for the caller's copy_to_parallel to sum", rank)


# ----------------------------------------------------------------------------- task6_3 the blocks


def block_parameters(world: int) -> int:
    """Parameters one rank keeps of one block: 1/W of every split weight and of the column
    layers' biases; the row layers' biases and the layer norms whole."""
    c = CONFIG["n_embd"]
    split = 4 * c * c + 8 * c * c + 3 * c + 4 * c  # q, k, v, out, up, down weights; col biases
    whole = 2 * c + 4 * c  # out_proj and down_proj biases; two layer norms
    return split // world + whole


def layer_input_grad_run(ctx, layer: str):
    """The input gradient of one split block part (attention or MLP) alone, on this rank."""
    ex = load_exercise(LESSON)
    with full_fp32():  # compared with a CPU run: no TF32
        block = make_gpt().blocks[0].to(ctx.device)
        part = (ex.TensorParallelAttention(block.attn) if layer == "attn"
                else ex.TensorParallelMLP(block.mlp))
        x = rank_weights(-4, (BATCH, CONFIG["block_size"], CONFIG["n_embd"])).to(ctx.device)
        x.requires_grad_(True)
        c = rank_weights(-5, x.shape).to(ctx.device)
        out = part(x)
        (out * c).sum().backward()
        return {"out": out.detach(), "grad": x.grad}


@pytest.mark.task6_3
@pytest.mark.parametrize("layer", ["attn", "mlp"])
@pytest.mark.parametrize("world", WORLDS)
def test_split_attention_and_mlp_give_the_input_its_whole_gradient(ex, layer, world):
    """The check a missing conjugate fails: the input's gradient on each rank is only its own
    slice's part (1/W of the whole, on average), and the message says so. Before the training
    test: with -x, its message is the one a learner reads first."""
    raise_if_untouched(ex.TensorParallelAttention.__init__, ex.TensorParallelMLP.__init__)
    results = run_on_ranks(layer_input_grad_run, layer, world_size=world)
    block = make_gpt().blocks[0]
    part = block.attn if layer == "attn" else block.mlp
    x = rank_weights(-4, (BATCH, CONFIG["block_size"], CONFIG["n_embd"])).requires_grad_(True)
    out = part(x)
    (out * rank_weights(-5, x.shape)).sum().backward()
    name = {"attn": "TensorParallelAttention", "mlp": "TensorParallelMLP"}[layer]
    for rank, got in enumerate(results):
        assert_close(got["out"], out.detach(), f"{name}'s output", rank)
        try:
            assert_close(got["grad"], x.grad, f"{name}: the gradient of its input", rank)
        except AssertionError as error:
            summed = sum(r["grad"] for r in results)
            mean_ratio = float((got["grad"] * x.grad).sum() / (x.grad * x.grad).sum())
            if torch.allclose(summed, x.grad, atol=1e-4):
                why = (f"each rank's input gradient is only its own heads' or features' part "
                       f"(on average 1/{world} of the whole: {mean_ratio:.2f} here); summed "
                       f"over the {world} ranks it is right. The copy_to_parallel (f) at the "
                       f"input of the split layers is missing")
            elif torch.allclose(got["grad"], world * x.grad, rtol=1e-3, atol=1e-4):
                why = (f"it is {world}x the whole: the input's gradient is all-reduced once "
                       f"too often. ReduceFromParallel's (g's) backward must pass the gradient "
                       f"through unchanged")
            else:
                why = ""
            raise AssertionError(f"{error}" + (f": {why}" if why else "")) from None


def hand_tp_run(ctx, steps: int):
    """The running example split by tensor_parallel_blocks, trained with SGD on the whole
    batch; every rank's parameters after each step, and the collectives of the first step."""
    ex = load_exercise(LESSON)
    with full_fp32():  # compared with a CPU run: no TF32
        model = ex.tensor_parallel_blocks(make_gpt().to(ctx.device))
        optimizer = torch.optim.SGD(model.parameters(), **SGD)
        block = model.blocks[0]
        out = {"states": [], "block_parameters": sum(p.numel() for p in block.parameters()),
               "storage": {name: (p.untyped_storage().nbytes(), p.numel() * p.element_size())
                           for name, p in block.named_parameters()}}
        for step in range(steps):
            inputs, targets = (t.to(ctx.device) for t in batch(step))
            optimizer.zero_grad(set_to_none=True)
            with CollectiveLog(ex) as forward:
                loss = forward_or_explain(model, inputs, targets, "tensor_parallel_blocks")
            with CollectiveLog(ex) as backward:
                loss.backward()
            optimizer.step()
            if step == 0:
                out["forward"] = [(c.op, c.payload) for c in forward.calls]
                out["backward"] = [(c.op, c.payload) for c in backward.calls]
            out["states"].append({name: local(p) for name, p in model.named_parameters()})
        return out


def assert_collectives(calls, phase: str, rank: int, hint: str) -> None:
    """One all-reduce of one activation per split layer pair: two per block."""
    __tracebackhide__ = True
    blocks = CONFIG["n_layer"]
    expected = [("all_reduce", activation_bytes())] * 2 * blocks
    if calls != expected:
        ops = [op for op, _ in calls]
        raise AssertionError(
            f"rank {rank}: the {phase} of {blocks} split blocks ran {len(calls)} collectives "
            f"({', '.join(sorted(set(ops))) or 'none'}), expected {2 * blocks} all-reduces of "
            f"{activation_bytes()} bytes (one activation, {BATCH} x {CONFIG['block_size']} x "
            f"{CONFIG['n_embd']} fp32): one for the attention and one for the MLP of each "
            f"block. {hint}")


@pytest.mark.task6_3
@pytest.mark.parametrize("group", GROUPS)
def test_tensor_parallel_gpt_trains_like_the_unsplit_model(ex, group):
    world, backend, device = group
    raise_if_untouched(ex.tensor_parallel_blocks, ex.TensorParallelAttention.__init__,
                       ex.TensorParallelMLP.__init__)
    results = run_on_ranks(hand_tp_run, STEPS, world_size=world, backend=backend, device=device)
    for rank, got in enumerate(results):
        assert got["block_parameters"] == block_parameters(world), (
            f"rank {rank}: keeps {got['block_parameters']} parameters of a block, expected "
            f"{block_parameters(world)}: 1/{world} of each split layer, the rest whole")
        assert_copies(got["storage"], rank, "block 0")
        assert_collectives(got["forward"], "forward", rank,
                           "In forward only the row-parallel layers (out_proj, down_proj) "
                           "all-reduce.")
        assert_collectives(got["backward"], "backward", rank,
                           "In backward only the copies into the split layers all-reduce: "
                           "the attention copies x once for q, k and v (copy_input=False on "
                           "each), the MLP's up_proj once.")
    for step, whole in enumerate(one_process()):
        assert_slices_of([r["states"][step] for r in results], whole,
                         f"after SGD step {step + 1}, the parameter")


@pytest.mark.task6_3
def test_split_attention_refuses_heads_that_do_not_divide(ex):
    """6 heads of 4 features on 4 ranks: 24 features split evenly (6 each), heads do not."""
    raise_if_untouched(ex.TensorParallelAttention.__init__)
    results = run_on_ranks(refused, "TensorParallelAttention", 0, 0, world_size=4,
                           n_head=6, n_embd=24)
    assert_refused(results, "TensorParallelAttention", 6, 4)


def pair_blocks_run(ctx) -> dict:
    """On 4 ranks in pairs [0, 1] and [2, 3], each pair on inputs of its own: the split
    attention and MLP with group= the pair (output and input gradient), and the running example
    split by tensor_parallel_blocks(model, group) (its loss)."""
    ex = load_exercise(LESSON)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    pair = ctx.rank // 2
    group = pairs[pair]
    block = make_gpt().blocks[0]
    out = {}
    for name, part in (("attn", ex.TensorParallelAttention(block.attn, group)),
                       ("mlp", ex.TensorParallelMLP(block.mlp, group))):
        x = rank_weights(-40 - pair, (BATCH, CONFIG["block_size"], CONFIG["n_embd"]))
        x.requires_grad_(True)
        y = part(x)
        (y * rank_weights(-5, x.shape)).sum().backward()
        out[name] = {"out": y.detach(), "grad": x.grad}
    model = ex.tensor_parallel_blocks(make_gpt(), group)
    out["loss"] = model(*batch(10 + pair))[1].detach()
    return out


@pytest.mark.task6_3
def test_split_blocks_use_their_group_only(ex):
    raise_if_untouched(ex.TensorParallelAttention.__init__, ex.TensorParallelMLP.__init__,
                       ex.tensor_parallel_blocks)
    results = run_on_ranks(pair_blocks_run, world_size=4)
    block, model = make_gpt().blocks[0], make_gpt()
    for rank, got in enumerate(results):
        pair = rank // 2
        mates = [2 * pair, 2 * pair + 1]
        for name, part in (("attn", block.attn), ("mlp", block.mlp)):
            what = {"attn": "TensorParallelAttention", "mlp": "TensorParallelMLP"}[name]
            x = rank_weights(-40 - pair, (BATCH, CONFIG["block_size"], CONFIG["n_embd"]))
            x.requires_grad_(True)
            y = part(x)
            (y * rank_weights(-5, x.shape)).sum().backward()
            hint = (f": with group={mates} every collective, and the slices each rank keeps, "
                    f"belong to that group of 2, not to all 4 ranks. Pass group to each split "
                    f"layer" + (" and keep it as self.group for the copy_to_parallel in forward"
                                if name == "attn" else ""))
            for key, want, kind in (("out", y.detach(), "output"), ("grad", x.grad,
                                                                    "input's gradient")):
                try:
                    assert_close(got[name][key], want, f"{what}(..., group={mates}): its {kind}",
                                 rank)
                except AssertionError as error:
                    raise AssertionError(f"{error}{hint}") from None
        with torch.no_grad():
            loss = model(*batch(10 + pair))[1]
        try:
            assert_close(got["loss"], loss, f"tensor_parallel_blocks(model, group={mates}): the "
                         f"loss", rank)
        except AssertionError as error:
            raise AssertionError(f"{error}: pass group on to every TensorParallelAttention and "
                                 f"TensorParallelMLP it builds") from None


def split_in_place(ctx) -> dict:
    ex = load_exercise(LESSON)
    model = make_gpt()
    returned = ex.tensor_parallel_blocks(model)
    return {"same": returned is model, "returned": type(returned).__name__,
            "parts": [(type(b.attn).__name__, type(b.mlp).__name__) for b in model.blocks]}


@pytest.mark.task6_3
def test_tensor_parallel_blocks_splits_the_model_in_place(ex):
    raise_if_untouched(ex.tensor_parallel_blocks)
    for rank, got in enumerate(run_on_ranks(split_in_place, world_size=2)):
        assert got["parts"] == [("TensorParallelAttention", "TensorParallelMLP")] * len(
            got["parts"]), (
            f"rank {rank}: after tensor_parallel_blocks(model), the model's own blocks hold "
            f"{got['parts']}: split them in place (block.attn = TensorParallelAttention(...), "
            f"block.mlp = TensorParallelMLP(...)), not a copy of the model")
        assert got["same"], (
            f"rank {rank}: tensor_parallel_blocks(model) returned a {got['returned']} that is "
            f"not model itself: return model, split in place")


# ----------------------------------------------------------------------------- task6_4 DTensor

PLACEMENTS = {  # the lesson's table: each split weight's placement on the tensor-parallel mesh
    "q_proj.weight": Shard(0), "q_proj.bias": Shard(0), "up_proj.weight": Shard(0),
    "out_proj.weight": Shard(1), "out_proj.bias": Replicate(), "down_proj.weight": Shard(1),
    "down_proj.bias": Replicate()}


def native_tp_run(ctx, steps: int):
    """parallelize_gpt on a 1-D mesh of every rank, trained as hand_tp_run is; the collectives
    of the first step counted by torch's CommDebugMode."""
    ex = load_exercise(LESSON)
    with full_fp32():  # compared with a CPU run: no TF32
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        model = ex.parallelize_gpt(make_gpt().to(ctx.device), mesh)
        optimizer = torch.optim.SGD(model.parameters(), **SGD)
        out = {"states": [], "placements": {
            name: tuple(p.placements) if isinstance(p, DTensor) else None
            for name, p in model.blocks[0].named_parameters()}}
        for step in range(steps):
            inputs, targets = (t.to(ctx.device) for t in batch(step))
            optimizer.zero_grad(set_to_none=True)
            # CommDebugMode counts DTensor's collectives; DispatchedAllReduces their bytes.
            with CommDebugMode() as forward, DispatchedAllReduces() as forward_bytes:
                loss = forward_or_explain(model, inputs, targets, "parallelize_gpt")
            with CommDebugMode() as backward, DispatchedAllReduces() as backward_bytes:
                loss.backward()
            optimizer.step()
            if step == 0:
                out["forward"], out["backward"] = comm_counts(forward), comm_counts(backward)
                out["bytes"] = [n for _, n in forward_bytes.calls + backward_bytes.calls]
            out["states"].append({name: local(p) for name, p in model.named_parameters()})
        return out


@pytest.mark.task6_4
@pytest.mark.parametrize("group", DTENSOR_GROUPS)
def test_parallelize_gpt_splits_and_trains_as_the_hand_version(ex, group):
    """The same slices on every rank as the hand version keeps, after every step, equal to the
    unsplit model's; and the same collectives: two all-reduces per block each way."""
    world, backend, device = group
    raise_if_untouched(ex.parallelize_gpt, ex.block_plan)
    results = run_on_ranks(native_tp_run, STEPS, world_size=world, backend=backend,
                           device=device)
    blocks = CONFIG["n_layer"]
    for rank, got in enumerate(results):
        for suffix, placement in PLACEMENTS.items():
            name = next(n for n in got["placements"] if n.endswith(suffix))
            assert got["placements"][name] == (placement,), (
                f"rank {rank}: block 0's {name} is placed {got['placements'][name]}, expected "
                f"({placement},): " + ("column-parallel layers (ColwiseParallel) shard rows"
                                       if placement == Shard(0) else
                                       "row-parallel layers (RowwiseParallel) shard the "
                                       "weight's columns and keep the bias whole"))
        assert got["forward"] == {"all_reduce": 2 * blocks}, (
            f"rank {rank}: the forward ran {got['forward'] or 'no collective'}, expected "
            f"{{'all_reduce': {2 * blocks}}}: one per RowwiseParallel layer")
        if got["backward"] != {"all_reduce": 2 * blocks}:
            extra = ("; each ColwiseParallel all-reduces its own input gradient unless the "
                     "attention's input is made a replicated DTensor once: PrepareModuleInput("
                     "..., use_local_output=False) on 'attn'"
                     if got["backward"].get("all_reduce", 0) == 4 * blocks else "")
            raise AssertionError(
                f"rank {rank}: the backward ran {got['backward'] or 'no collective'}, expected "
                f"{{'all_reduce': {2 * blocks}}} as in the hand version (one per block for the "
                f"attention's q, k and v together, one for the MLP){extra}")
        assert got["bytes"] == [activation_bytes()] * 4 * blocks, (
            f"rank {rank}: DTensor's all-reduces moved {got['bytes']} bytes each, expected "
            f"{activation_bytes()} (one activation, as in the hand version)")
    for step, whole in enumerate(one_process()):
        assert_slices_of([r["states"][step] for r in results], whole,
                         f"after SGD step {step + 1}, the local shard of")


@pytest.mark.task6_4
def test_parallelize_gpt_refuses_heads_that_do_not_divide(ex):
    """DTensor itself would shard 6 heads' 24 features over 4 ranks as 6 each: 1.5 heads."""
    raise_if_untouched(ex.parallelize_gpt)
    results = run_on_ranks(refused, "parallelize_gpt", 0, 0, world_size=4, n_head=6, n_embd=24)
    assert_refused(results, "parallelize_gpt", 6, 4)


# ----------------------------------------------------------------------------- task6_5 2-D

MESH_2D = (2, 2)  # (dp, tp)


def two_d_run(ctx, steps: int):
    """parallelize_2d on a (dp 2) x (tp 2) mesh of 4 ranks. The two ranks of a tp row read the
    same half of the batch; the two rows read different halves. Whole parameters after each
    step, and where block 0's weights live."""
    ex = load_exercise(LESSON)
    with full_fp32():  # compared with a CPU run: no TF32
        mesh = init_device_mesh(ctx.device.type, MESH_2D, mesh_dim_names=("dp", "tp"))
        try:
            model = ex.parallelize_2d(make_gpt().to(ctx.device), mesh)
        except (NotImplementedError, AssertionError):
            raise
        except Exception as error:  # noqa: BLE001 - torch's words, with what to do
            raise AssertionError(
                f"parallelize_2d on a dp 2 x tp 2 mesh raised {type(error).__name__}: "
                f"{str(error).splitlines()[0][:300]}. Split with tensor parallelism on mesh['tp'] "
                f"first, then fully_shard each block and the root on mesh['dp']") from None
        optimizer = torch.optim.SGD(model.parameters(), **SGD)
        dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
        # The README: init_device_mesh fills rows first, so a tp group is neighbouring ranks.
        out = {"states": [], "placements": {}, "tp_group": mesh["tp"].mesh.tolist(),
               "dp_group": mesh["dp"].mesh.tolist(),
               "blocks_sharded": all(isinstance(b, FSDPModule) for b in model.blocks),
               "root_sharded": isinstance(model, FSDPModule)}
        for name, p in model.blocks[0].named_parameters():
            out["placements"][name] = ((p.device_mesh.mesh_dim_names, tuple(map(str, p.placements)),
                                        p.to_local().numel())
                                       if isinstance(p, DTensor) else None)
        for step in range(steps):
            inputs, targets = (t.chunk(dp_size)[dp_rank].to(ctx.device) for t in batch(step))
            optimizer.zero_grad(set_to_none=True)
            forward_or_explain(model, inputs, targets, "parallelize_2d").backward()
            optimizer.step()
            whole = {name: p.full_tensor() if isinstance(p, DTensor) else p
                     for name, p in model.named_parameters()}
            out["states"].append({name: t.detach().cpu() for name, t in whole.items()})
        return out


@pytest.mark.task6_5
@pytest.mark.parametrize("group", group_params(world_sizes=(4,), cuda_world_sizes=(),
                                               nccl_world_sizes=(4,)))
def test_2d_trains_like_one_process_on_the_whole_batch(ex, group):
    world, backend, device = group
    raise_if_untouched(ex.parallelize_2d)
    results = run_on_ranks(two_d_run, STEPS, world_size=world, backend=backend, device=device,
                           timeout=60)
    for rank, got in enumerate(results):
        row = rank // MESH_2D[1]
        assert (got["tp_group"], got["dp_group"]) == (
            [2 * row, 2 * row + 1], [rank % 2, rank % 2 + 2]), (
            f"rank {rank}: init_device_mesh put it in tp group {got['tp_group']} and dp group "
            f"{got['dp_group']}: not the rows-first layout the lesson describes")
        layout = got["placements"]
        q = next(v for n, v in layout.items() if n.endswith("q_proj.weight"))
        assert q is not None and q[0] == ("dp", "tp"), (
            f"rank {rank}: block 0's q_proj.weight lives on {q and q[0]}, expected the 2-D "
            f"mesh ('dp', 'tp'): tensor-parallel on mesh['tp'] first, then fully_shard on "
            f"mesh['dp']")
        assert q[1][1] == str(Shard(0)), (
            f"rank {rank}: q_proj.weight is placed {q[1]} on (dp, tp); on tp it must be "
            f"Shard(0) (column parallel)")
        whole = CONFIG["n_embd"] ** 2
        assert q[2] == whole // world, (
            f"rank {rank}: holds {q[2]} elements of q_proj.weight, expected {whole // world}: "
            f"1/{MESH_2D[1]} by tensor parallelism, and that halved again by FSDP")
        assert got["blocks_sharded"], (
            f"rank {rank}: the blocks are not FSDP modules: fully_shard each block on "
            f"mesh['dp'] before the root, so that a block's weights are gathered just before it "
            f"runs rather than the whole model at once")
        assert got["root_sharded"], (
            f"rank {rank}: the model itself is not an FSDP module: the embeddings, the final "
            f"norm and the head are then never averaged across the dp rows. fully_shard(model, "
            f"mesh=mesh['dp']) last")
        ln = next(v for n, v in layout.items() if n.endswith("ln_1.weight"))
        assert ln is not None and ln[0] == ("dp",), (
            f"rank {rank}: block 0's ln_1.weight lives on {ln and ln[0]}, expected FSDP's "
            f"mesh['dp'] only (the layer norms are not split by tensor parallelism)")
    for step, whole in enumerate(one_process()):
        for rank, got in enumerate(results):
            assert_parameters_close(got["states"][step], whole, f"after SGD step {step + 1}, "
                                    f"dp 2 x tp 2 vs one process: parameter", rank)


def refused_mesh(ctx, shape: tuple | None = None, names: tuple | None = None):
    """What parallelize_2d does with a mesh of ``shape`` (default: 1-D over every rank) named
    ``names``: the error it raises, as text, or None when it accepts it."""
    ex = load_exercise(LESSON)
    mesh = init_device_mesh("cpu", shape or (ctx.world_size,), mesh_dim_names=names)
    try:
        ex.parallelize_2d(make_gpt(), mesh)
    except NotImplementedError:
        raise
    except ValueError as error:
        return f"ValueError: {error}"
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return None


@pytest.mark.task6_5
def test_2d_refuses_a_mesh_without_dp_and_tp(ex):
    raise_if_untouched(ex.parallelize_2d)
    for rank, message in enumerate(run_on_ranks(refused_mesh, world_size=2)):
        assert message is not None and message.startswith("ValueError"), (
            f"rank {rank}: parallelize_2d on a 1-D mesh gave {message}; raise ValueError "
            f"saying it needs a 2-D mesh named ('dp', 'tp')")
        assert "dp" in message and "tp" in message, message


@pytest.mark.task6_5
def test_2d_refuses_a_2d_mesh_named_otherwise(ex):
    raise_if_untouched(ex.parallelize_2d)
    messages = run_on_ranks(refused_mesh, MESH_2D, ("data", "model"), world_size=4)
    for rank, message in enumerate(messages):
        assert message is not None and message.startswith("ValueError"), (
            f"rank {rank}: parallelize_2d on a 2 x 2 mesh named ('data', 'model') gave "
            f"{message}; a 2-D mesh is not enough: check its mesh_dim_names too, and raise "
            f"ValueError saying it needs ('dp', 'tp')")
        assert "dp" in message and "tp" in message, (
            f"rank {rank}: the ValueError should say the mesh needs the names 'dp' and 'tp': "
            f"{message}")


# ----------------------------------------------------------------------------- the script

# train_tp.py is lesson 05's train_fsdp.py with tensor parallelism inside FSDP2. It runs under
# the real torchrun on 4 ranks, dp 2 x tp 2 with batch 8 per data-parallel row (tp 2 alone is
# the same code with dp 1; the course's integrity tests launch that too). It must take the steps
# of one process on batches of 16: lesson 03's fit(), on a pooled rank.
TRAIN = ("--epochs", "1", "--train-windows", "64")  # 4 steps of 16 windows
# Another summation order, with AdamW amplifying rounding where a gradient is rounding noise
# (lesson 03 measured this bound).
SAME_STEPS = {"rtol": 1e-3, "atol": 2e-4}
TINY_PARAMETERS = 55_808


start_launches_first = start_first("script_run")  # while the other checks run


@pytest.fixture(scope="module")
def script_run(tmp_path_factory):
    checkpoint = tmp_path_factory.mktemp("checkpoints") / "tp.pt"
    run = start_script(SCRIPT, *TRAIN, "--tp", "2", "--batch-size", "8", "--checkpoint",
                       str(checkpoint), launcher="torchrun", nproc=4)
    yield run, checkpoint
    run.stop()


@pytest.fixture(scope="module")
def reference():
    return run_on_ranks(one_process_fit, 64, world_size=1, timeout=120)[0]


def assert_trains_like_one_process(data: dict, weights: dict, reference: dict, what: str):
    __tracebackhide__ = True
    for key in ("train_loss", "val_loss"):
        assert_close(torch.tensor(data[key]), torch.tensor(reference["result"][key]),
                     f"{what} vs one process x 16: {key} per epoch", **SAME_STEPS)
    assert_parameters_close(weights, reference["state"], what=f"trained parameter, {what} vs "
                            "one process", **SAME_STEPS)
    one = reference["result"]["sample_before"]
    assert data["sample_before"] == one, (
        f"{what}: sampled {data['sample_before']!r} before training, one process {one!r}")
    vocab_size = CharDataset(SIZES["tiny"]["block_size"]).vocab_size
    model = GPT(GPTConfig.named("tiny", vocab_size=vocab_size))
    model.load_state_dict(weights)
    assert parameter_digest(model) == data["params_sha256"], (
        f"{what}: the digest rank 0 reported is not that of the weights it gathered")


@pytest.mark.slow
def test_script_2d_on_four_ranks_trains_what_one_process_trains(script_run, reference):
    launch, checkpoint = script_run
    run = launch.result()
    assert (run.data["world_size"], run.data["dp"], run.data["tp"]) == (4, 2, 2), run.data
    weights = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert_trains_like_one_process(run.data, weights, reference, "dp 2 x tp 2, 8 per row")
    # What the blocks split (weights, and the column-parallel layers' biases: 50,048 of the
    # 55,808 parameters) is cut 4 ways, the rest 2 ways; FSDP's padding aside.
    split = 4 * (12 * 32 * 32 + 3 * 32 + 4 * 32)
    expected = 4 * (split / 4 + (TINY_PARAMETERS - split) / 2)
    for rank, sizes in enumerate(run.data["bytes_per_rank"]):
        assert abs(sizes["parameters"] - expected) <= 0.1 * expected, (
            f"rank {rank} stores {sizes['parameters']} bytes of parameters, expected about "
            f"{expected:.0f}: {sizes}")
    assert "dp 2 x tp 2" in run.output and not [line for line in run.rank_lines(1)
                                                   if "epoch" in line], run.output


# CUDA kernels add in another order than the CPU's (lesson 03 measured the same bound).
CUDA_VS_CPU = {"rtol": 1e-4, "atol": 1e-5}


@pytest.mark.slow
@pytest.mark.parametrize("gpus", [pytest.param(n, marks=gpu_marks(n, f"nccl, tp {n}"),
                                               id=f"tp{n}") for n in (1, 2)])
def test_script_on_gpus_trains_what_one_process_trains_on_the_cpu(reference, gpus):
    """On GPUs the script runs nccl, one GPU per rank, every rank in one TP group: the CPU
    reference's losses to CUDA's rounding."""
    run = run_script(SCRIPT, *TRAIN, "--batch-size", "16", launcher="torchrun", nproc=gpus)
    assert (run.data["backend"], run.data["device"], run.data["tp"]) == ("nccl", "cuda:0",
                                                                         gpus), run.data
    for key in ("train_loss", "val_loss"):
        assert_close(torch.tensor(run.data[key]), torch.tensor(reference["result"][key]),
                     f"tp {gpus} on GPUs vs one CPU process x 16: {key}", **CUDA_VS_CPU)


@pytest.fixture
def train_script(outside_launcher):
    """train_tp.py, imported, to call its main() as plain python would run it."""
    return load_lesson_module(LESSON, "train_tp")


def test_script_refuses_a_tp_degree_that_does_not_fit(train_script, capsys):
    """One process: --tp 2 needs two."""
    assert train_script.main(["--tp", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tp 2" in err[0] and "1 process" in err[0], err
    assert not dist.is_initialized()


def test_script_names_the_default_tp_degree_and_what_it_must_divide(train_script, monkeypatch,
                                                                     capsys):
    """8 processes and no --tp: the default, 8, cannot split the tiny model's 4 heads."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert train_script.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tp 8 (the default: every process)" in err[0], err
    assert "4 heads" in err[0] and "try --tp 4" in err[0] and "processes" not in err[0], err


def test_script_explains_a_partial_launcher_environment(train_script, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train_script.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "LOCAL_RANK" in err[0] and "train_tp.py" in err[0], err
