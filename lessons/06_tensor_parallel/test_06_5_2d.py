"""Lesson 06, task6_5: 2-D parallelism (parallelize_2d): tensor parallelism on mesh['tp'] inside
FSDP2 on mesh['dp'], on a dp 2 x tp 2 mesh of 4 ranks, trains as one process on the whole batch
does; a mesh without the names 'dp' and 'tp' is refused. On gloo/CPU ranks (and nccl on GPUs).

    pytest lessons/06_tensor_parallel -m task6_5
"""

from __future__ import annotations

import pytest
import torch
from gpt import run
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from harness.compare import assert_parameters_close, full_fp32
from harness.exercises import load_exercise, raise_if_untouched
from harness.ranks import group_params, run_on_ranks
from lesson06.common import (
    CONFIG,
    LESSON,
    SGD,
    STEPS,
    batch,
    forward_or_explain,
    make_gpt,
    one_process,
)

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
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


MESH_2D = (2, 2)  # (dp, tp)


def two_d_run(ctx, steps: int):
    """parallelize_2d on a (dp 2) x (tp 2) mesh of 4 ranks. The two ranks of a tp row read the
    same half of the batch; the two rows read different halves. Whole parameters after each
    step, and where block 0's weights live."""
    ex = load_exercise(LESSON)
    with full_fp32():  # compared with a CPU run: no TF32
        mesh = run.device_mesh(ctx.device.type, MESH_2D, ("dp", "tp"))  # 60 s waits
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
    """`parallelize_2d` on a dp 2 × tp 2 mesh of 4 gloo ranks, each row on half of the batch, trains
    as one process on the whole batch: every parameter after each of 3 SGD steps; each rank holds
    1/4 of q_proj's weight, Shard(0) on tp, and ln_1's on dp only.

    Also checked: the mesh's tp groups are neighbouring ranks (rows first), and every block and the
    model itself are FSDP modules."""
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
    """`parallelize_2d` raises a ValueError naming 'dp' and 'tp' for a 1-D mesh of 2 gloo ranks."""
    raise_if_untouched(ex.parallelize_2d)
    for rank, message in enumerate(run_on_ranks(refused_mesh, world_size=2)):
        assert message is not None and message.startswith("ValueError"), (
            f"rank {rank}: parallelize_2d on a 1-D mesh gave {message}; raise ValueError "
            f"saying it needs a 2-D mesh named ('dp', 'tp')")
        assert "dp" in message and "tp" in message, message


@pytest.mark.task6_5
def test_2d_refuses_a_2d_mesh_named_otherwise(ex):
    """`parallelize_2d` raises a ValueError naming 'dp' and 'tp' for a 2 × 2 mesh named ('data',
    'model') on 4 gloo ranks: it checks the names, not only the shape."""
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
