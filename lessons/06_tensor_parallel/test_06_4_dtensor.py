"""Lesson 06, task6_4: the same split with torch's DTensor (block_plan, parallelize_gpt): the
same slices on every rank as the hand version keeps, trained as the unsplit model is, with the
same collectives, counted by torch's CommDebugMode. On gloo/CPU ranks (and nccl on GPUs).

    pytest lessons/06_tensor_parallel -m task6_4
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from harness.collectives import DispatchedAllReduces
from harness.compare import full_fp32
from harness.exercises import load_exercise, raise_if_untouched
from harness.ranks import group_params, run_on_ranks
from lesson06.common import (
    CONFIG,
    LESSON,
    SGD,
    STEPS,
    WORLDS,
    activation_bytes,
    assert_refused,
    assert_slices_of,
    batch,
    forward_or_explain,
    local,
    make_gpt,
    one_process,
    refused,
)

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
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
}


# DTensor with gloo on CUDA tensors is not a combination the course has run: nccl only on GPUs.
DTENSOR_GROUPS = group_params(world_sizes=WORLDS, cuda_world_sizes=(), nccl_world_sizes=WORLDS)


PLACEMENTS = {  # the lesson's table: each split weight's placement on the tensor-parallel mesh
    "q_proj.weight": Shard(0), "q_proj.bias": Shard(0), "up_proj.weight": Shard(0),
    "out_proj.weight": Shard(1), "out_proj.bias": Replicate(), "down_proj.weight": Shard(1),
    "down_proj.bias": Replicate()}


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
    """`parallelize_gpt` with `block_plan()` is the hand version, on 2 and 4 gloo ranks: Shard(0),
    Shard(1) and Replicate placements, every rank's local shards against its slices of the unsplit
    model after each of 3 SGD steps, and 2 all-reduces of one activation per block each way.

    The collectives are counted by torch's CommDebugMode, their bytes from the tensors each
    all-reduce is dispatched with. A backward of 4 all-reduces per block is named as a missing
    `PrepareModuleInput(..., use_local_output=False)` on attn."""
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
    """`parallelize_gpt` raises a ValueError naming 6 and 4 for 6 heads of 4 features on 4 gloo
    ranks, which DTensor alone would shard as 6 features each: a head and a half."""
    raise_if_untouched(ex.parallelize_gpt)
    results = run_on_ranks(refused, "parallelize_gpt", 0, 0, world_size=4, n_head=6, n_embd=24)
    assert_refused(results, "parallelize_gpt", 6, 4)
