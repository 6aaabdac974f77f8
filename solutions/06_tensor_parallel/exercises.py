"""Lesson 06 exercises: tensor parallelism. Layers split by hand, then with DTensor, then 2-D.

Grade with ``pytest lessons/06_tensor_parallel`` (one task: ``-m task6_1``). Each function's
docstring is its contract: what it takes, what it returns, and what the test checks.

Every rank of a tensor-parallel group runs the same layers on the same input, each with its own
slice of every weight matrix. ``group`` is that group of ranks (``None``: all of them); W is its
size and "rank" means the rank within it, ``dist.get_rank(group)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpt import MLP, CausalSelfAttention
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)


def split_size(size: int, world_size: int, what: str) -> int:
    """``size / world_size``, each rank's share of a dimension, when it divides evenly.

    Otherwise a ``ValueError`` that names both numbers (``what`` says which dimension), instead
    of the shape error torch would raise much later, or of heads cut in half, which raise none.
    """
    if size % world_size:
        raise ValueError(f"{what} {size} does not divide by the tensor-parallel degree "
                         f"{world_size}: each of the {world_size} ranks must get an equal share")
    return size // world_size


# --8<-- [start:CopyToParallel]
class CopyToParallel(torch.autograd.Function):
    """Where a replicated activation enters the split layers (Megatron-LM's *f*).

    ``CopyToParallel.apply(x, group)``. Forward: ``x`` unchanged, no communication (every rank
    already has it whole). Backward: the gradient is the **sum over the group's ranks** of the
    gradients arriving here, an all-reduce: each rank's slice of the layers that follow saw only
    part of how ``x`` was used. Returns ``(gradient, None)`` (``group`` has no gradient).
    All-reduce a copy, never the tensor autograd hands in: it may be shared with another branch
    (the residual connection's, for one).

    The test checks the output and the input gradient against the single-device computation on
    2 and 4 ranks, and counts one all-reduce in backward and none in forward.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group=None) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
# --8<-- [end:CopyToParallel]


# --8<-- [start:ReduceFromParallel]
class ReduceFromParallel(torch.autograd.Function):
    """Where the split layers' partial results become one replicated activation (*g*).

    ``ReduceFromParallel.apply(x, group)``. Forward: the sum over the group's ranks of ``x``
    (each rank's partial result), an all-reduce of a copy. Backward: the gradient unchanged, no
    communication: the sum's gradient with respect to each term is the sum's own gradient.
    Returns ``(gradient, None)``.

    *f* and *g* are each other's conjugates: one all-reduce in the forward of one, in the
    backward of the other. The test checks output and input gradient on 2 and 4 ranks, and
    counts one all-reduce in forward and none in backward.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group=None) -> torch.Tensor:
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None
# --8<-- [end:ReduceFromParallel]


def copy_to_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    return CopyToParallel.apply(x, group)


def reduce_from_parallel(x: torch.Tensor, group=None) -> torch.Tensor:
    return ReduceFromParallel.apply(x, group)


# --8<-- [start:ColumnParallelLinear]
class ColumnParallelLinear(nn.Module):
    """This rank's slice of ``linear``'s output features: rows of its weight (out, in).

    ``ColumnParallelLinear(linear, group=None, copy_input=True)``, from a whole ``nn.Linear``:
    with ``n = split_size(out_features, W, "out_features")``, keep ``weight[rank*n:(rank+1)*n]``
    as ``self.weight`` and the same slice of the bias as ``self.bias`` (``None`` when the layer
    has no bias), both new ``nn.Parameter``s (copies: the whole layer can then be freed).

    ``forward(x)``: ``x`` (..., in_features) whole on every rank; returns (..., n), this rank's
    slice of the whole layer's output, no communication. With ``copy_input``, ``x`` first goes
    through ``copy_to_parallel``, so that its gradient is complete (summed over the ranks); a
    caller that has already done so for several layers at once passes ``copy_input=False``.

    The test checks the output slice, the input gradient and the weight and bias gradients
    (reassembled from every rank's slice) against the unsplit layer, that each rank keeps only
    its slice, and the error for ``out_features`` that do not divide.
    """

    def __init__(self, linear: nn.Linear, group=None, copy_input: bool = True):
        super().__init__()
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        rows = split_size(linear.out_features, world_size, "out_features")
        mine = slice(rank * rows, (rank + 1) * rows)
        self.weight = nn.Parameter(linear.weight.detach()[mine].clone())
        self.bias = (nn.Parameter(linear.bias.detach()[mine].clone())
                     if linear.bias is not None else None)
        self.group, self.copy_input = group, copy_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_parallel(x, self.group)
        return F.linear(x, self.weight, self.bias)
# --8<-- [end:ColumnParallelLinear]


# --8<-- [start:RowParallelLinear]
class RowParallelLinear(nn.Module):
    """This rank's slice of ``linear``'s input features: columns of its weight (out, in).

    ``RowParallelLinear(linear, group=None)``: with ``n = split_size(in_features, W,
    "in_features")``, keep ``weight[:, rank*n:(rank+1)*n]`` as ``self.weight``, and the whole
    bias as ``self.bias`` (``None`` without one): every rank keeps it, all the same.

    ``forward(x)``: ``x`` (..., n) is this rank's slice of the input features (what a
    ``ColumnParallelLinear`` before it returns). ``x @ weight.T`` is this rank's partial sum of
    the whole output; ``reduce_from_parallel`` adds the ranks' partial sums; **then** the bias,
    once. (Adding it before the all-reduce would add it W times.) Returns (..., out_features),
    whole and the same on every rank.

    The test checks the output, the input slice's gradient and the weight and bias gradients
    against the unsplit layer, the bias counted once, and the error for ``in_features`` that
    do not divide.
    """

    def __init__(self, linear: nn.Linear, group=None):
        super().__init__()
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        columns = split_size(linear.in_features, world_size, "in_features")
        mine = slice(rank * columns, (rank + 1) * columns)
        self.weight = nn.Parameter(linear.weight.detach()[:, mine].clone())
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_parallel(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y
# --8<-- [end:RowParallelLinear]


# --8<-- [start:TensorParallelMLP]
class TensorParallelMLP(MLP):
    """The running example's MLP, split: ``up_proj`` by columns, ``down_proj`` by rows.

    ``TensorParallelMLP(mlp, group=None)`` from a whole ``gpt.MLP``: ``self.up_proj`` a
    ``ColumnParallelLinear`` of ``mlp.up_proj``, ``self.down_proj`` a ``RowParallelLinear`` of
    ``mlp.down_proj``, ``self.drop = mlp.drop``. It is an ``MLP`` (call ``nn.Module.__init__``,
    not ``MLP.__init__``, which would build whole layers again), so ``MLP.forward`` runs as it
    is: GELU acts element by element, so it needs every hidden feature of a position only on
    the rank that holds it, and one all-reduce (in ``down_proj``) ends the block.

    The test trains it (inside the running example) for several steps against the unsplit
    model, and counts one all-reduce per forward and one per backward.
    """

    def __init__(self, mlp: MLP, group=None):
        nn.Module.__init__(self)
        self.up_proj = ColumnParallelLinear(mlp.up_proj, group)
        self.down_proj = RowParallelLinear(mlp.down_proj, group)
        self.drop = mlp.drop
# --8<-- [end:TensorParallelMLP]


# --8<-- [start:TensorParallelAttention]
class TensorParallelAttention(CausalSelfAttention):
    """The running example's attention, split by heads: each rank computes n_head / W heads.

    ``TensorParallelAttention(attn, group=None)`` from a whole ``gpt.CausalSelfAttention``:
    the number of heads (``attn.q_proj.out_features // attn.head_dim``) must divide by W
    (``split_size(heads, W, "n_head")``): a rank holds whole heads, never part of one. Then
    ``q_proj``, ``k_proj`` and ``v_proj`` become ``ColumnParallelLinear``s with
    ``copy_input=False`` (a head's output features are consecutive rows, so a slice of rows is
    a set of whole heads) and ``out_proj`` a ``RowParallelLinear``; ``head_dim``, ``dropout``
    and ``resid_drop`` are kept, and ``group`` as ``self.group`` for the forward. Like
    ``TensorParallelMLP``, call ``nn.Module.__init__``.

    ``forward(x)``: ``copy_to_parallel(x, group)`` once, for all three projections (one
    all-reduce in backward, not three), then ``CausalSelfAttention.forward`` as it is: it
    reshapes to ``-1`` heads, so it runs this rank's heads.

    The test trains it for several steps against the unsplit model, counts one all-reduce per
    forward and one per backward, and checks the error for heads that do not divide.
    """

    def __init__(self, attn: CausalSelfAttention, group=None):
        nn.Module.__init__(self)
        heads = attn.q_proj.out_features // attn.head_dim
        split_size(heads, dist.get_world_size(group), "n_head")
        self.head_dim, self.dropout, self.resid_drop = attn.head_dim, attn.dropout, attn.resid_drop
        self.q_proj, self.k_proj, self.v_proj = (
            ColumnParallelLinear(proj, group, copy_input=False)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        self.out_proj = RowParallelLinear(attn.out_proj, group)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(copy_to_parallel(x, self.group))
# --8<-- [end:TensorParallelAttention]


# --8<-- [start:tensor_parallel_blocks]
def tensor_parallel_blocks(model: nn.Module, group=None) -> nn.Module:
    """Split every block of the running example ``model`` (a ``gpt.GPT``) in place: each
    ``block.attn`` becomes a ``TensorParallelAttention``, each ``block.mlp`` a
    ``TensorParallelMLP``. Everything else (embeddings, layer norms, head) stays whole and
    replicated: its input and its gradient are the same on every rank. Returns ``model``.
    """
    for block in model.blocks:
        block.attn = TensorParallelAttention(block.attn, group)
        block.mlp = TensorParallelMLP(block.mlp, group)
    return model
# --8<-- [end:tensor_parallel_blocks]


# --8<-- [start:block_plan]
def block_plan() -> dict:
    """The ``parallelize_module`` plan for one ``gpt.Block``: fully-qualified submodule names
    (relative to the block) to ``ParallelStyle``s, the hand version's split in torch's words.

    - ``attn.q_proj``, ``attn.k_proj``, ``attn.v_proj``, ``mlp.up_proj``: ``ColwiseParallel()``
      (weight and bias ``Shard(0)``: rows, output features);
    - ``attn.out_proj``, ``mlp.down_proj``: ``RowwiseParallel()`` (weight ``Shard(1)``, bias
      ``Replicate()``; the output's partial sums are all-reduced, then the bias added);
    - ``attn``: ``PrepareModuleInput(input_layouts=(Replicate(),),
      desired_input_layouts=(Replicate(),), use_local_output=False)``. It makes the attention's
      input a replicated DTensor once, so the three projections' input gradients add up as one
      and are all-reduced once; without it each ``ColwiseParallel`` all-reduces its own (three).

    The test compares the counts of all-reduces per forward and backward with the hand version.
    """
    return {
        "attn": PrepareModuleInput(input_layouts=(Replicate(),),
                                   desired_input_layouts=(Replicate(),), use_local_output=False),
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.out_proj": RowwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
# --8<-- [end:block_plan]


# --8<-- [start:parallelize_gpt]
def parallelize_gpt(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Tensor-parallel ``model`` (a ``gpt.GPT``) over the 1-D ``mesh``, with ``block_plan``.

    First the checks torch does not make: DTensor shards a dimension that does not divide
    unevenly, so 6 heads on 4 ranks would silently give ranks 1.5 heads' features. So
    ``split_size`` the number of heads (``model.config.n_head``) and the MLP's hidden size
    (``4 * model.config.n_embd``) by ``mesh.size()`` first. Then ``parallelize_module(block,
    mesh, block_plan())`` for every block. Returns ``model``; its split weights are now DTensors.

    The test trains it against the hand version and the unsplit model, checks the placements
    of the weights, counts the collectives with ``CommDebugMode``, and checks the errors.
    """
    tp = mesh.size()
    split_size(model.config.n_head, tp, "n_head")
    split_size(4 * model.config.n_embd, tp, "MLP hidden size")
    for block in model.blocks:
        parallelize_module(block, mesh, block_plan())
    return model
# --8<-- [end:parallelize_gpt]


# --8<-- [start:parallelize_2d]
def parallelize_2d(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Tensor parallel inside, sharded data parallel across: ``mesh`` is 2-D, named
    ``("dp", "tp")``, e.g. ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``.

    1. ``parallelize_gpt(model, mesh["tp"])``: the ranks of one row of the mesh split each
       layer (they read the same batch);
    2. ``fully_shard(block, mesh=mesh["dp"])`` for every block, then ``fully_shard(model,
       mesh=mesh["dp"])``: each TP slice is sharded again across the data-parallel ranks (the
       mesh's columns), which read different batches; FSDP averages their gradients.

    The order matters: ``parallelize_module`` expects plain parameters, and FSDP shards the TP
    DTensors it finds. A mesh without the two names raises a ``ValueError`` saying what it needs.

    The test trains it on 4 ranks (dp 2 x tp 2) for several steps against one process on the
    whole batch, and checks each weight's placements on both mesh dimensions.
    """
    if mesh.ndim != 2 or mesh.mesh_dim_names != ("dp", "tp"):
        raise ValueError(f"parallelize_2d needs a 2-D mesh named ('dp', 'tp'), got "
                         f"{mesh.ndim}-D {mesh.mesh_dim_names}")
    parallelize_gpt(model, mesh["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model
# --8<-- [end:parallelize_2d]
