"""Lesson 08, task8_6: fsdp_step_collectives predicts the collectives of one FSDP2 step. The
oracle is FSDP2 itself, run in torch's fake process group (one process, any world size) and
counted as torch dispatches each collective (dry_run.py's counter, itself checked against the
Python-level counter of lessons 05 and 06 on a real gloo run). Each clause alone first, then
generated models swept against the oracle, then a real 2-rank run.

    pytest lessons/08_measure_and_choose -m task8_6
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from harness.collectives import CollectiveLog
from harness.exercises import load_lesson_module, raise_if_untouched
from harness.ranks import in_a_child, run_on_ranks
from harness.sweep import st, sweep
from lesson08.common import LESSON, assert_refuses

# The task's contract, clause by clause, and the tests that fail when only that clause is broken
# (tests/test_course.py checks the names).
CLAUSES = {
    "task8_6": {
        "each parameter padded to ceil(rows / W) * W rows, parameter by parameter": [
            "test_each_parameter_travels_padded_to_a_multiple_of_the_world",
            "test_fsdp_step_collectives_agrees_with_fsdp2_in_a_fake_world"],
        "a unit that reshards gathers before its forward and again before its backward": [
            "test_a_unit_gathers_again_for_its_backward_only_if_it_resharded",
            "test_fsdp_step_collectives_agrees_with_fsdp2_in_a_fake_world"],
        "the root gathers once": [
            "test_the_root_gathers_once_whatever_the_units_do",
            "test_fsdp_step_collectives_agrees_with_fsdp2_in_a_fake_world"],
        "one reduce-scatter per group, in reduce_bytes (None: param_bytes)": [
            "test_gradients_reduce_in_their_own_dtype",
            "test_payloads_are_elements_times_their_bytes_for_any_element_size",
            "test_fsdp_step_collectives_agrees_with_fsdp2_in_a_fake_world"],
        "a group without parameters issues nothing": [
            "test_a_group_without_parameters_issues_nothing",
            "test_fsdp_step_collectives_agrees_with_fsdp2_in_a_fake_world"],
        "world_size < 2, an empty shape or dimension, bytes < 1: ValueError": [
            "test_fsdp_step_collectives_refuses_what_cannot_be_sharded"],
        "a real 2-rank run on gloo issues what the fake world and the formula say": [
            "test_a_real_two_rank_run_issues_the_predicted_collectives"],
    },
}

PRECISIONS = {  # name -> (param_dtype, reduce_dtype) of the MixedPrecisionPolicy, their bytes
    "fp32": ((None, None), (4, None)),
    "bf16": ((torch.bfloat16, None), (2, None)),
    "bf16, fp32 reduction": ((torch.bfloat16, torch.float32), (2, 4)),
}


def script():
    return load_lesson_module(LESSON, "dry_run")


class Unit(nn.Module):
    """Parameters of the given shapes, each of which the output depends on."""

    def __init__(self, shapes):
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(torch.ones(shape)) for shape in shapes])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + sum((w.sum() for w in self.weights), torch.zeros((), dtype=x.dtype))


class Model(nn.Module):
    def __init__(self, root, units):
        super().__init__()
        self.blocks = nn.ModuleList([Unit(shapes) for shapes in units])
        self.own = Unit(root)  # a plain submodule: its parameters are the root's group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.own(x)


def shard(model: nn.Module, mesh, precision: str, reshard_after_forward: bool) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    (param_dtype, reduce_dtype), _ = PRECISIONS[precision]
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def fsdp2_in_a_fake_world(root, units, world_size: int, precision: str = "fp32",
                          reshard_after_forward: bool = True) -> list[tuple[str, int]]:
    """The oracle: what FSDP2 dispatches in one step of that model, as rank 0 of a fake world.
    Called through ``in_a_child``: the fake group must be its process's default group, and
    FSDP2's backward would leave this process unfit to fork the rank pool from."""
    dry_run = script()
    with dry_run.fake_world(0, world_size) as mesh:
        model = shard(Model(root, units), mesh, precision, reshard_after_forward)
        with dry_run.CollectivesAtDispatch() as sent:
            model(torch.zeros(2, requires_grad=True)).sum().backward()
    return sent.calls


def oracle(*args) -> list[tuple[str, int]]:
    """``fsdp2_in_a_fake_world(*args)`` in a child process, forked from this one once it has
    imported what FSDP2 needs: the first fully_shard imports torch._dynamo, 1.5 s paid here
    once rather than in every child."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    script()
    return in_a_child(fsdp2_in_a_fake_world, *args)


def predicted(ex, root, units, world_size, precision="fp32", reshard_after_forward=True):
    _, (param_bytes, reduce_bytes) = PRECISIONS[precision]
    return ex.fsdp_step_collectives(root, units, world_size, param_bytes, reduce_bytes,
                                    reshard_after_forward)


def assert_same(ex, why: str, root, units, world_size, precision="fp32",
                reshard_after_forward=True) -> None:
    got = predicted(ex, root, units, world_size, precision, reshard_after_forward)
    want = oracle(root, units, world_size, precision, reshard_after_forward)
    assert Counter(got) == Counter(want), (
        f"{why}\n  fsdp_step_collectives(root={root}, units={units}, world_size={world_size}, "
        f"{precision}, reshard_after_forward={reshard_after_forward})\n  returned "
        f"{sorted(got)}\n  FSDP2 issued {sorted(want)}")


# ----------------------------------------------------------------------------- clause by clause


# Each test varies one clause and keeps the others at rest: the padding with the units keeping
# their parameters (one all-gather each), every group with parameters until the test of the
# empty one, fp32 until the test of the dtypes.


@pytest.mark.task8_6
def test_each_parameter_travels_padded_to_a_multiple_of_the_world(ex):
    """Each parameter travels padded to ceil(rows / W) * W rows, one by one, not the group's total:
    a (3, 2) parameter on 4 ranks moves 4 rows, two 1-element ones on 2 ranks 2 rows each, and 65
    rows on 128 ranks 128; against FSDP2 itself in a fake world, its units keeping their parameters.
    """
    kept = dict(reshard_after_forward=False)
    assert_same(ex, "a (3, 2) parameter on 4 ranks is cut into pieces of ceil(3 / 4) = 1 row, "
                    "and travels as 4 rows of 2: 32 bytes in fp32, not 24 (the payload is the "
                    "gathered whole, padding included, not one rank's piece)",
                [(4,)], [[(3, 2)]], 4, **kept)
    assert_same(ex, "each parameter is padded on its own, not the group's flat total: two "
                    "1-element parameters on 2 ranks travel as 2 rows each",
                [(2,)], [[(1,), (1,)]], 2, **kept)
    assert_same(ex, "a 65-row parameter on 128 ranks travels as 128 rows (63 ranks hold none "
                    "of it: their piece is all padding)", [(2,)], [[(65, 3)]], 128, **kept)


@pytest.mark.task8_6
def test_the_root_gathers_once_whatever_the_units_do(ex):
    """The root gathers its own parameters once: alone on 2 ranks one all-gather and one
    reduce-scatter, and on 3 ranks once while its two resharding units gather twice each; against
    FSDP2 in a fake world."""
    assert_same(ex, "torch keeps the root's parameters after its forward (its backward runs "
                    "first): one all-gather, one reduce-scatter", [(6, 2)], [], 2)
    assert_same(ex, "the root gathers once, while each unit, which freed its parameters, gathers "
                    "them again before its backward", [(6, 2), (3,)], [[(4, 4)], [(5,)]], 3)


@pytest.mark.task8_6
def test_a_unit_gathers_again_for_its_backward_only_if_it_resharded(ex):
    """A unit that frees its parameters after the forward gathers them again before its backward
    (two all-gathers, one reduce-scatter); with reshard_after_forward=False it gathers once; against
    FSDP2 in a fake world of 2 ranks."""
    assert_same(ex, "a unit that freed its parameters after its forward gathers them again "
                    "before its backward: two all-gathers, one reduce-scatter",
                [(2,)], [[(4, 4)]], 2)
    assert_same(ex, "with reshard_after_forward=False a unit keeps its parameters from forward "
                    "to backward: one all-gather", [(2,)], [[(4, 4)], [(2,)]], 2,
                reshard_after_forward=False)


@pytest.mark.task8_6
def test_gradients_reduce_in_their_own_dtype(ex):
    """The gradients reduce in their own dtype: bf16 parameters with no reduce dtype reduce in bf16
    (reduce_bytes None means param_bytes), with fp32 reduction all-gathers move 2 bytes an element
    and reduce-scatters 4; against FSDP2 in a fake world of 2 ranks."""
    assert_same(ex, "bf16 parameters with no reduce_dtype: the gradients reduce in bf16 too "
                    "(reduce_bytes=None means param_bytes)", [(4,)], [[(4, 4)]], 2, "bf16")
    assert_same(ex, "bf16 parameters, fp32 reduction: all-gathers of 2 bytes an element, "
                    "reduce-scatters of 4", [(4,)], [[(4, 4)]], 2, "bf16, fp32 reduction")


@pytest.mark.task8_6
def test_payloads_are_elements_times_their_bytes_for_any_element_size(ex):
    """Every payload is elements times their size, for any element size: at 1 and 8 bytes (fp8,
    fp64) and mixed pairs, all-gathers scale by param_bytes and reduce-scatters by reduce_bytes from
    the fp32 step FSDP2 runs in a fake world of 4 ranks.

    The fake world's step is not run at those sizes here: their payloads are scaled from fp32's,
    element for element."""
    raise_if_untouched(ex.fsdp_step_collectives)  # before the oracle's fake world starts
    root, units = [(5, 3)], [[(4, 4), (3,)], [(7,)]]
    fp32 = Counter(oracle(root, units, 4))
    for param_bytes, reduce_bytes in [(1, 1), (1, 4), (8, 8), (2, 1)]:
        want = Counter({(op, payload // 4 * (param_bytes if op == "all_gather" else reduce_bytes)):
                        count for (op, payload), count in fp32.items()})
        got = ex.fsdp_step_collectives(root, units, 4, param_bytes, reduce_bytes)
        assert Counter(got) == want, (
            f"with param_bytes={param_bytes}, reduce_bytes={reduce_bytes} every all-gather "
            f"moves param_bytes per element and every reduce-scatter reduce_bytes (1 is a "
            f"size, fp8's): expected {sorted(want.elements())}, got {sorted(got)}")


@pytest.mark.task8_6
def test_a_group_without_parameters_issues_nothing(ex):
    """A group without parameters issues nothing, not a collective of 0 bytes: units without
    parameters, and a root whose parameters all belong to units; against FSDP2 in a fake world."""
    assert_same(ex, "a unit without parameters issues no collective (not one of 0 bytes)",
                [], [[], [(2, 2)], []], 2)
    assert_same(ex, "a root whose parameters all belong to units issues no collective",
                [], [[(3,)]], 2)


@pytest.mark.task8_6
def test_fsdp_step_collectives_refuses_what_cannot_be_sharded(ex):
    """`fsdp_step_collectives` raises ValueError for what cannot be sharded: a world of 1 or 0
    ranks, a parameter with no dimension, a dimension of 0 or a negative one, param_bytes or
    reduce_bytes 0."""
    for arguments, why in [
        (([(4,)], [], 1), "world_size 1: one rank shards nothing"),
        (([(4,)], [], 0), "world_size 0"),
        (([()], [], 2), "a parameter with no dimension (FSDP2 shards along the first)"),
        (([], [[(0, 3)]], 2), "a dimension of 0 in a unit's parameter"),
        (([(2, -1)], [], 2), "a negative dimension"),
        (([(4,)], [], 2, 0), "param_bytes 0"),
        (([(4,)], [], 2, 4, 0), "reduce_bytes 0"),
    ]:
        assert_refuses(ex.fsdp_step_collectives, arguments, why)


# -------------------------------------------------------------------- generated models, swept

shapes = st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple), max_size=3)


@pytest.mark.task8_6
@sweep(max_examples=40, root=shapes, units=st.lists(shapes, max_size=3),
       world_size=st.one_of(st.integers(2, 9), st.sampled_from([16, 100, 128])),
       precision=st.sampled_from(sorted(PRECISIONS)), reshard_after_forward=st.booleans())
def test_fsdp_step_collectives_agrees_with_fsdp2_in_a_fake_world(ex, root, units, world_size,
                                                                 precision, reshard_after_forward):
    """`fsdp_step_collectives` names the collectives FSDP2 issues, counted as torch dispatches them
    in its fake process group, on 40 generated models: 0 to 3 units and a root of up to 3
    parameters, 2 to 9, 16, 100 or 128 ranks, fp32, bf16 or bf16 with fp32 reduction, either reshard
    setting.

    Each parameter has 1 to 3 dimensions of 1 to 9."""
    assert_same(ex, "not what FSDP2 issues for this model", root, units, world_size, precision,
                reshard_after_forward)


# ------------------------------------------------------------------------- a real 2-rank run


def one_real_step(ctx, root, units) -> tuple[list, list]:
    """One FSDP2 step of the model on real gloo ranks: the collectives as dispatched, and as
    the Python-level counter sees them (op, payload)."""
    from torch.distributed.device_mesh import init_device_mesh

    dry_run = script()
    model = shard(Model(root, units), init_device_mesh("cpu", (ctx.world_size,)), "fp32", True)
    with CollectiveLog() as log, dry_run.CollectivesAtDispatch() as sent:
        model(torch.zeros(2, requires_grad=True)).sum().backward()
    return sent.calls, [(call.op, call.payload) for call in log.calls]


@pytest.mark.task8_6
def test_a_real_two_rank_run_issues_the_predicted_collectives(ex):
    """A real FSDP2 step on 2 gloo ranks issues what the fake world and the formula say: on each
    rank the dispatch counter equals the Python-level counter of lessons 05 and 06 and the fake
    world's step, and `fsdp_step_collectives` predicts the same."""
    raise_if_untouched(ex.fsdp_step_collectives)
    root, units = [(5, 3), (2,)], [[(4, 4), (3,)], [(7,)], []]
    fake = oracle(root, units, 2)
    for rank, (dispatched, called) in enumerate(run_on_ranks(one_real_step, root, units)):
        assert Counter(dispatched) == Counter(called), (
            f"rank {rank}: the dispatch counter disagrees with the Python-level one "
            f"({sorted(dispatched)} against {sorted(called)}): the oracle itself is broken")
        assert Counter(dispatched) == Counter(fake), (
            f"rank {rank} of a real gloo run issued {sorted(dispatched)}, the fake world "
            f"{sorted(fake)}: the dry run would not predict the real job")
    got = ex.fsdp_step_collectives(root, units, 2)
    assert Counter(got) == Counter(fake), (
        f"a real 2-rank run issued {sorted(fake)}; fsdp_step_collectives said {sorted(got)}")
