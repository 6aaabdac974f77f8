"""Lesson 06, task6_2: the split layers (ColumnParallelLinear, RowParallelLinear) compute what
the unsplit layer computes: outputs, the input's gradient and the weights' gradients, each rank
keeping a copy of its slice, with the collectives of the lesson and within their group only. On
gloo/CPU ranks (and on CUDA where present).

    pytest lessons/06_tensor_parallel -m task6_2
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from harness.collectives import CollectiveLog
from harness.compare import assert_close, full_fp32
from harness.exercises import load_exercise, raise_if_untouched
from harness.ranks import run_on_ranks
from lesson06.common import (
    GROUPS,
    HIDDEN,
    IN,
    LESSON,
    OUT,
    assert_copies,
    assert_refused,
    pair_run,
    rank_weights,
    refused,
    whole_layer,
)

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
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
}


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
    """ColumnParallelLinear and RowParallelLinear with `group=` take their rank and size from it: on
    4 gloo ranks in two groups of 2, each rank keeps half of the column layer's rows, and a column
    then a row layer give the unsplit layers' output on the pair's own input, the bias added once.
    """
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


def assert_ran(got: dict, rank: int, what: str) -> None:
    __tracebackhide__ = True
    assert_copies(got["storage"], rank, what)
    if "error" in got:
        raise AssertionError(f"rank {rank}: {what}'s forward raised RuntimeError: "
                             f"{got['error']}")


@pytest.mark.task6_2
@pytest.mark.parametrize("group", GROUPS)
def test_column_parallel_linear_equals_the_unsplit_layer(ex, group):
    """ColumnParallelLinear is the unsplit 8-to-12 layer, on 2 and 4 gloo ranks: each rank keeps a
    copy of its rows of weight and bias, outputs its slice of the features with no forward
    collective, gets the whole input gradient, and the weight and bias gradients put back together
    are the unsplit ones.

    A copy, not a view: the slice's storage is its own size, or the whole weight would stay in
    memory. An input gradient that only sums to the right one over the ranks is named as a missing
    copy_to_parallel."""
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
    """RowParallelLinear is the unsplit 12-to-6 layer, on 2 and 4 gloo ranks: each rank keeps a copy
    of its columns of the weight and the whole bias, all-reduces once in the forward and adds the
    bias once; output, input-slice and bias gradients, and the weight gradients put back together,
    are the unsplit ones.

    An output off by W - 1 biases (added before the all-reduce) or by a missing bias is named."""
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


@pytest.mark.task6_2
@pytest.mark.parametrize("builder,in_features,out_features,size", [
    ("ColumnParallelLinear", 8, 6, 6), ("RowParallelLinear", 6, 8, 6)], ids=["column", "row"])
def test_split_layers_refuse_sizes_that_do_not_divide(ex, builder, in_features, out_features,
                                                       size):
    """ColumnParallelLinear and RowParallelLinear raise a ValueError naming the size and the number
    of ranks when the dimension they split does not divide: 6 output (column) or 6 input (row)
    features on 4 gloo ranks."""
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
    """Split layers made from an `nn.Linear(..., bias=False)` have a bias of None: a column
    (8-to-12) then a row (12-to-6) layer without bias, on 2 gloo ranks, give the unsplit pair's
    output."""
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
    """`ColumnParallelLinear(..., copy_input=False)` runs no collective in the backward: on 2 gloo
    ranks, each rank's input gradient is its own part only (its upstream slice times its rows), left
    for the caller's copy_to_parallel to sum."""
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
